"""The results table of examples/gclsr/repro.sh: ``python examples/gclsr/table.py OUT full base``.

Reads ``OUT/ROW/{sts.json,timing.json,summary.json,log.jsonl,machine.txt}`` for each row and
writes ``OUT/results.md`` (the table, wall times, machine load, training-curve and collapse
statistics) and ``OUT/results.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

LABELS = {
    "full": "GCLSR_base + PWVA + self-att. + GP (paper preset)",
    "base": "GCLSR_base (no PWVA, no attention, no grouping)",
}
ORDER = ("sts12", "sts13", "sts14", "sts15", "sts16", "stsb", "sickr", "avg")


def _log_stats(path: Path) -> dict:
    """First / last training loss and std of the normalised projector output (collapse -> 0;
    healthy ~ 1/sqrt(proj_dim)), and the STS-B dev curve."""
    if not path.is_file():
        return {}
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    train = [r for r in records if "loss" in r]
    dev = [(r["step"], r["stsb_dev"]) for r in records if "stsb_dev" in r]
    out = {"dev_curve": dev}
    if train:
        out.update(
            first_loss=train[0]["loss"],
            last_loss=train[-1]["loss"],
            first_std_z=train[0].get("std_z"),
            last_std_z=train[-1].get("std_z"),
        )
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out, rows = Path(argv[0]), argv[1:]
    results: dict = {"rows": {}}
    for row in rows:
        d = out / row
        sts = json.loads((d / "sts.json").read_text())
        results.setdefault("avg_word_vectors", sts["avg_word_vectors"])
        results["rows"][row] = {
            "label": LABELS.get(row, row),
            "sts": sts["gclsr"],
            "timing": json.loads((d / "timing.json").read_text()),
            "summary": json.loads((d / "summary.json").read_text()),
            "machine": (d / "machine.txt").read_text().strip().splitlines(),
            **_log_stats(d / "log.jsonl"),
        }
    tasks = [t for t in ORDER if t in results["avg_word_vectors"]]
    lines = [
        "| encoder | "
        + " | ".join(t.upper() if t != "sickr" else "SICK-R" for t in tasks)
        + " | best dev step | train s |",
        "|---" * (len(tasks) + 3) + "|",
    ]
    base = results["avg_word_vectors"]
    lines.append(
        "| averaged word vectors (same vectors) | " + " | ".join(f"{base[t]:.2f}" for t in tasks) + " | - | - |"
    )
    for r in results["rows"].values():
        lines.append(
            f"| {r['label']} | "
            + " | ".join(f"{r['sts'][t]:.2f}" for t in tasks)
            + f" | {r['summary']['best_step']} | {r['timing']['train_s']} |"
        )
    notes = []
    for row, r in results["rows"].items():
        notes.append(
            f"- `{row}`: `fastcl train gclsr --preset paper {r['timing']['args'].strip()}`; "
            f"{r['summary']['steps']} steps, train {r['timing']['train_s']} s, STS {r['timing']['sts_s']} s; "
            f"loss {r.get('first_loss', float('nan')):.4f} -> {r.get('last_loss', float('nan')):.4f}, "
            f"std_z {r.get('first_std_z')} -> {r.get('last_std_z')}; "
            f"STS-B dev {[round(s, 2) for _, s in r.get('dev_curve', [])]}"
        )
        notes += [f"  - {m}" for m in r["machine"]]
    text = "\n".join(["# GCLSR reproduction", "", *lines, "", *notes, ""])
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
