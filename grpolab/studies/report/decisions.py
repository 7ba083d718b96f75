"""What a decision suite decided (``[decide]``): the question, a table of each arm's decision with its round,
evidence and compute, and a figure of every comparison's confidence sequence over the rounds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpolab.studies.manifest import MANIFEST, SuiteManifest


def decision_data(directory: Path) -> dict[str, Any] | None:
    """The decisions of the suite in ``directory`` (None for a suite without ``[decide]`` or a plain run)."""
    if not (directory / MANIFEST).is_file():
        return None
    manifest = SuiteManifest.load(directory)
    if manifest.decide is None:
        return None
    arms = list(dict.fromkeys(r.arm for r in manifest.runs))
    steps = {r.name: r.config["steps"] for r in manifest.runs}
    last = manifest.decisions[-1]["verdicts"] if manifest.decisions else {}
    rows = []
    for arm in arms:
        mine = [r for r in manifest.runs if r.arm == arm]
        ran = [r for r in mine if r.state == "completed"]
        verdict = last.get(arm, {"status": "open", "round": None, "evidence": "no round decided yet"})
        rows.append(
            {
                "arm": arm,
                "decision": verdict["status"],
                "round": verdict["round"],
                "evidence": verdict["evidence"],
                "seeds_run": len(ran),
                "seeds_budget": len(mine),
                "steps_run": sum(steps[r.name] for r in ran),
                "steps_budget": sum(steps[r.name] for r in mine),
            }
        )
    return {
        "question": manifest.decide,
        "rounds": manifest.decisions,
        "arms": rows,
        "steps_run": sum(r["steps_run"] for r in rows),
        "steps_budget": sum(r["steps_budget"] for r in rows),
        "answered": bool(last) and all(v["status"] != "open" for v in last.values()),
    }


def decision_section(d: dict[str, Any]) -> list[str]:
    """report.md's section on the decisions."""
    q = d["question"]
    against = f"against {q['baseline']}" if q["baseline"] else "find the best (every pair compared)"
    sequence = (
        f"Robbins' normal mixture at a stated seed_sd {q['seed_sd']:g}"
        if q["sequence"] == "normal"
        else "betting (Waudby-Smith and Ramdas 2024; no assumption but the bounds)"
    )
    out = [
        f"Question: {against}; delta {q['delta']:g}, alpha {q['alpha']:g} family-wise at every round at once; "
        f"seeds {q['seeds']}; confidence sequence: {sequence}. "
        + (
            "The question is answered." if d["answered"] else "Arms still open when the budget ran out are not decided."
        ),
        "",
        "| arm | decision | round | evidence | seeds run | training steps run |",
        "|---|---|---|---|---|---|",
    ]
    for r in d["arms"]:
        out.append(
            f"| {r['arm']} | {r['decision']} | {'-' if r['round'] is None else r['round']} | {r['evidence']} | "
            f"{r['seeds_run']}/{r['seeds_budget']} | {r['steps_run']}/{r['steps_budget']} |"
        )
    saved = 1 - d["steps_run"] / d["steps_budget"] if d["steps_budget"] else 0.0
    out += ["", f"Compute: {d['steps_run']} of {d['steps_budget']} training steps ({saved:.0%} saved)."]
    if d["rounds"]:  # the last round's: every comparison's spread over all the seeds it has
        out += [f"\nWarning: {w}" for w in d["rounds"][-1].get("warnings", [])]
    return out


def decision_figure(d: dict[str, Any], out_dir: Path) -> tuple[str, str] | None:
    """Each comparison's bounds after each round, with -delta and +delta marked."""
    if not d["rounds"]:
        return None
    import matplotlib.pyplot as plt  # the report's figures set the headless backend

    delta = d["question"]["delta"]
    pairs = [(c["arm"], c["other"]) for c in d["rounds"][0]["comparisons"]]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(pairs) + 2.0))
    width = 0.8 / len(d["rounds"])
    for k, record in enumerate(d["rounds"]):
        for i, c in enumerate(record["comparisons"]):
            if c["n"] == 0:
                continue
            y = i + (k - (len(d["rounds"]) - 1) / 2) * width
            ax.plot([c["lower"], c["upper"]], [y, y], lw=3, color=plt.cm.viridis(k / max(1, len(d["rounds"]) - 1)))
            ax.plot([c["mean"]], [y], "k|", ms=8)
    for k in range(len(d["rounds"])):
        ax.plot([], [], lw=3, color=plt.cm.viridis(k / max(1, len(d["rounds"]) - 1)), label=f"after round {k}")
    ax.axvline(-delta, color="tab:red", ls="--", lw=1, label=f"-delta ({-delta:g})")
    ax.axvline(delta, color="tab:green", ls="--", lw=1, label=f"+delta ({delta:g})")
    ax.axvline(0, color="grey", lw=0.5)
    ax.set_yticks(range(len(pairs)), [f"{a} - {b}" for a, b in pairs])
    ax.invert_yaxis()
    ax.set_xlabel("paired accuracy difference: confidence sequence after each round (| = mean)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    name = "decisions.png"
    fig.savefig(out_dir / name, dpi=110)
    plt.close(fig)
    return "each comparison's confidence sequence over the rounds", name
