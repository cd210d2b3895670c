"""The one table `run_gpu.py` ends with: what every GPU benchmark measured, per method, and issue 40's targets.

Read from the results the steps wrote (`<name>_<device>.json`), written as `summary_<device>.md` / `.json`:

- the machine (GPU name, versions) and every step's status and time, the CUDA tests' counts;
- encoder methods at 25 %: TTFT against the unpatched model and against the oracle (the LLM fed as many tokens with
  zero selection cost) and the selection's share of the unpruned TTFT, on LLaVA-1.5 at batch 1, 8 and 32, on
  LLaVA-NeXT, the 32-frame OneVision video and Qwen2.5-VL at batch 1 (and the Qwen families' baselines);
- LLM-stage methods at batch 1, 8 and 32: against unpatched and the equal-average oracle;
- sparse prefill against dense attention, end to end per prompt length, and the kernel at density 0.1;
- the targets (every encoder method >= 0.95x of the oracle at batch 8/32 and on LLaVA-NeXT / the OneVision video at
  batch 1, DivPrune >= 0.93x; selection <= 2 % of TTFT; LLM stages >= 0.97x of unpatched at batch 1 and >= 0.9x of
  the equal-average oracle at batch 8/32; sparse prefill never slower than dense), each with its value and pass or
  fail. A ratio whose spread reaches the bound counts as reaching it (the timing rule: within noise).
"""

from __future__ import annotations

import json
from pathlib import Path

BUDGET = "0.25"
ORACLE, ORACLE_DIVPRUNE, SHARE = 0.95, 0.93, 0.02
LLM_BATCH1, LLM_ORACLE = 0.97, 0.9


def _load(out: Path, stem: str, device: str) -> dict | None:
    path = out / f"{stem}_{device}.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def _ratio(value) -> str:
    return "" if value is None else f"{value:.2f}x"


def _share(value) -> str:
    return "" if value is None else f"{value:.1%}"


def _cell(row: dict | None) -> str:
    """'vs unpatched / vs oracle / selection share' of one results row."""
    if not row:
        return "-"
    parts = [_ratio(row.get("speedup")), _ratio(row.get("vs_oracle")), _share(row.get("selection_share"))]
    return " / ".join(p or "-" for p in parts)


def _encoder_sources(out: Path, device: str) -> list[tuple[str, dict]]:
    """(column title, {method: row at the 25 % budget}) of every encoder benchmark that ran."""
    sources = []
    batches = _load(out, "llava15_batch", device)
    for batch, rows in (batches or {}).get("ttft", {}).items():
        sources.append((f"LLaVA-1.5 {batch.replace('batch', 'b')}", _at_budget(rows)))
    methods = _load(out, "methods", device)
    titles = {"llava-1.5-7b": "LLaVA-1.5 b1 (methods)", "llava-next-7b": "LLaVA-NeXT b1",
              "llava-onevision-7b video": "OneVision video b1", "qwen2.5-vl-7b": "Qwen2.5-VL b1"}  # fmt: skip
    for key, rows in (methods or {}).get("results", {}).items():
        if key in titles and isinstance(rows, dict):
            sources.append((titles[key], _at_budget(rows)))
    for stem in ("families", "qwen3_vl"):
        for title, rows in ((_load(out, stem, device) or {}).get("results", {})).items():
            if isinstance(rows, dict):
                sources.append((title.split(" (")[0], _at_budget(rows)))
    return sources


def _at_budget(rows: dict) -> dict:
    """{method: its row at the 25 % budget}, from rows keyed 'method@budget'."""
    return {key.split("@")[0]: row for key, row in rows.items() if key.endswith(f"@{BUDGET}") and "oracle" not in key}


def _lengths(rows: dict) -> dict:
    """The per-length rows of a sparse-prefill table (other entries, as the warm-up's, left out)."""
    return {tokens: row for tokens, row in rows.items() if str(tokens).isdigit()}


def _llm_rows(out: Path, device: str) -> dict[str, dict[str, dict]]:
    """{method: {batch: row}} of the LLM stages' batch table."""
    stages = (_load(out, "llm_stages", device) or {}).get("results", {}).get("by_batch", {})
    table: dict[str, dict[str, dict]] = {}
    for batch, rows in stages.items():
        for name, row in rows.items():
            if name != "unpatched":  # the baseline
                table.setdefault(name, {})[str(batch)] = row
    return table


def targets(out: Path, device: str) -> list[dict]:
    """Every target check of the run: what, its value, the bound, whether it is met."""
    checks = []

    def check(what: str, value, bound: str, met: bool) -> None:
        checks.append({"check": what, "value": value, "bound": bound, "met": bool(met)})

    batches = (_load(out, "llava15_batch", device) or {}).get("ttft", {})
    for batch in ("batch8", "batch32"):
        for name, row in _at_budget(batches.get(batch, {})).items():
            floor = ORACLE_DIVPRUNE if name == "divprune" else ORACLE
            check(f"LLaVA-1.5 {batch} {name}@{BUDGET}: TTFT vs oracle", row.get("vs_oracle"), f">= {floor}",
                  (row.get("vs_oracle_high") or 0) >= floor)  # fmt: skip
            if row.get("selection_share") is not None:
                check(f"LLaVA-1.5 {batch} {name}@{BUDGET}: selection / TTFT", row["selection_share"], f"<= {SHARE:.0%}",
                      row["selection_share"] <= SHARE)  # fmt: skip
    results = (_load(out, "methods", device) or {}).get("results", {})
    for model in ("llava-next-7b", "llava-onevision-7b video"):
        for key, row in results.get(model, {}).items():
            name, _, budget = key.partition("@")
            if not budget or name in ("unpatched", "oracle"):
                continue
            floor = ORACLE_DIVPRUNE if name == "divprune" else ORACLE
            check(f"{model} b1 {key}: TTFT vs oracle", row.get("vs_oracle"), f">= {floor}",
                  (row.get("vs_oracle_high") or 0) >= floor)  # fmt: skip
            if row.get("selection_share") is not None:
                check(f"{model} b1 {key}: selection / TTFT", row["selection_share"], f"<= {SHARE:.0%}",
                      row["selection_share"] <= SHARE)  # fmt: skip
    for name, by_batch in _llm_rows(out, device).items():
        first = by_batch.get("1")
        if first:
            check(f"LLM stage {name} b1: TTFT vs unpatched", first.get("speedup"), f">= {LLM_BATCH1}",
                  (first.get("speedup_high") or 0) >= LLM_BATCH1)  # fmt: skip
        for batch in ("8", "32"):
            row = by_batch.get(batch)
            if row:
                check(f"LLM stage {name} b{batch}: TTFT vs equal-average oracle", row.get("vs_oracle"),
                      f">= {LLM_ORACLE}", (row.get("vs_oracle_high") or 0) >= LLM_ORACLE)  # fmt: skip
    sparse = (_load(out, "sparse_prefill", device) or {}).get("results", {})
    for tokens, rows in _lengths(sparse.get("end_to_end", {})).items():
        for name in ("sparse", "pruning + sparse"):
            row = rows.get(name)
            if row is None:
                continue
            versus = "pruning alone" if name == "pruning + sparse" else "dense"
            value = row.get("speedup_vs_reference")
            high = (row.get("vs_pruning_alone") or {}).get("high") if name == "pruning + sparse" else None
            high = high if high is not None else row.get("speedup_high") if versus == "dense" else value
            check(f"sparse prefill {tokens} tokens, {name}: TTFT vs {versus}", value, ">= 1 (never slower)",
                  (high or 0) >= 1.0)  # fmt: skip
    return checks


def write_summary(out: Path, device: str, info: dict, steps: list[dict], tests: dict | None = None,
                  smoke: bool = False) -> dict:  # fmt: skip
    """Write summary_<device>.md and .json from the results in `out`; returns the payload (with "markdown")."""
    sources = _encoder_sources(out, device)
    methods = sorted({name for _, rows in sources for name in rows})
    lines = [
        f"# vtoken on {info.get('gpu', device)}",
        "",
        f"torch {info.get('torch')}, triton {info.get('triton')}, transformers {info.get('transformers')}, vtoken "
        f"{info.get('vtoken')}, Python {info.get('python')}. Random weights, real shapes, bf16, full depth; medians of "
        "interleaved runs (each benchmark's own table has the spreads).",
    ]
    if smoke:
        lines += ["", "**CPU smoke run at tiny shapes: it shows that every step runs; it measures nothing.**"]
    lines += ["", "| step | status | seconds |", "|---|---|---:|"]
    lines += [f"| {s['step']} | {s['status']} | {s['seconds']} |" for s in steps]
    if tests is not None:
        lines += ["", f"CUDA tests: {tests['passed']} passed, {tests['failures']} failed, {tests['errors']} errors, "
                      f"{tests['skipped']} skipped."]  # fmt: skip
        lines += [f"- failing: {name}" for name in tests.get("failing", [])]
    lines += [
        "",
        f"## Encoder methods at {float(BUDGET):.0%}: TTFT vs unpatched / vs oracle / selection share of unpruned TTFT",
        "",
        "| method | " + " | ".join(title for title, _ in sources) + " |",
        "|---|" + "---|" * len(sources),
    ]
    lines += [f"| {name} | " + " | ".join(_cell(rows.get(name)) for _, rows in sources) + " |" for name in methods]
    llm = _llm_rows(out, device)
    batches = sorted({b for rows in llm.values() for b in rows}, key=int)
    lines += [
        "",
        "## LLM stages: TTFT vs unpatched / vs the equal-average oracle",
        "",
        "| method | " + " | ".join(f"batch {b}" for b in batches) + " |",
        "|---|" + "---|" * len(batches),
    ]
    lines += [f"| {name} | " + " | ".join(f"{_ratio(rows[b].get('speedup')) or '-'} / "
                                            f"{_ratio(rows[b].get('vs_oracle')) or '-'}" if b in rows else "-"
                                            for b in batches) + " |" for name, rows in sorted(llm.items())]  # fmt: skip
    sparse = (_load(out, "sparse_prefill", device) or {}).get("results", {})
    end_to_end = _lengths(sparse.get("end_to_end", {}))
    lines += ["", "## Sparse prefill vs dense (TTFT, end to end; kernel at density 0.1 vs SDPA)", ""]
    lines += ["| tokens | sparse (break-even) | sparse (forced) | pruning + sparse vs pruning | attention ran |",
              "|---:|---|---|---|---|"]  # fmt: skip
    for tokens, rows in end_to_end.items():
        ran = (rows.get("sparse") or {}).get("attention_ran", "")
        sparse_, forced, both = (rows.get(name) or {} for name in ("sparse", "sparse (forced)", "pruning + sparse"))
        lines.append(f"| {tokens} | {_ratio(sparse_.get('speedup_vs_dense')) or '-'} | "
                     f"{_ratio(forced.get('speedup_vs_dense')) or '-'} | "
                     f"{_ratio(both.get('speedup_vs_reference')) or '-'} | {ran} |")  # fmt: skip
    kernel = sparse.get("kernel", {}).get("lengths", {})
    if kernel:
        lines += ["", "| tokens | vtoken kernel at 0.1 | FlexAttention at 0.1 | kernel at density 1 |",
                  "|---:|---|---|---|"]  # fmt: skip
        for tokens, row in kernel.items():
            at = row.get("densities", {})
            lines.append(f"| {tokens} | {_ratio((at.get('0.1') or {}).get('own', {}).get('speedup')) or '-'} | "
                         f"{_ratio((at.get('0.1') or {}).get('flex', {}).get('speedup')) or '-'} | "
                         f"{_ratio((at.get('1') or {}).get('own', {}).get('speedup')) or '-'} |")  # fmt: skip
    checks = targets(out, device)
    met = sum(c["met"] for c in checks)
    lines += [
        "",
        f"## Targets: {met} of {len(checks)} met" + (" (a CPU smoke run: not GPU targets)" if smoke else ""),
        "",
        "| target | value | bound | pass |",
        "|---|---:|---|---|",
    ]
    lines += [f"| {c['check']} | {c['value'] if c['value'] is None else format(c['value'], '.3g')} | {c['bound']} | "
              f"{'pass' if c['met'] else 'FAIL'} |" for c in checks]  # fmt: skip
    markdown = "\n".join(lines) + "\n"
    payload = {"environment": info, "steps": steps, "tests": tests, "smoke": smoke, "targets": checks,
               "encoder": {title: rows for title, rows in sources}, "llm_stages": llm,
               "sparse_prefill": end_to_end}  # fmt: skip
    (out / f"summary_{device}.md").write_text(markdown)
    (out / f"summary_{device}.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return {**payload, "markdown": markdown}
