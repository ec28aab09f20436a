"""Writers: every table as CSV (machines) + Markdown and LaTeX (people), written atomically side by side.

The builders' long DataFrames go to CSV unchanged (with intervals and bold flags as columns); Markdown and LaTeX
are rendered from them here. Bold is `**x**` in Markdown and `\\textbf{x}` in LaTeX.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Callable, Sequence

import polars as pl

from calibrate.tables import layout
from schemas.atomic import atomic_path, write_text_atomic

DASH = "–"
#: marks a difference whose 95% interval contains zero
NS_MARK = "†"
#: marks a temperature-scaling cell scored on the labelled data its temperature was fitted on (or an average with one)
IN_SAMPLE_MARK = "‡"
#: marks a value (or a method in a figure) computed on a partial run (`--allow-partial`); the footnote gives its n
PARTIAL_MARK = "§"
#: after an interval lying wholly below (above) its estimate: the basic bootstrap's bias correction exceeds the
#: sampling spread (`calibrate.tables.bootstrap.basic_interval`)
BELOW_MARK, ABOVE_MARK = "↓", "↑"
#: what BELOW_MARK means, where the table is read
BELOW_LEGEND = (f"{BELOW_MARK} after an interval: it lies wholly below its estimate. Intervals are basic bootstrap "
                "intervals (2 × estimate − replicate quantiles; Kumar et al., 2019): binned ECE (and a resampled one "
                "more so) is biased upwards, and where the bootstrap finds that bias larger than the sampling spread "
                "(a small ECE, few samples per bin) the true value is likely below the estimate, which the interval "
                "says; percentile or BCa intervals would sit above the estimate and miss small true ECEs. The "
                "interval's centre, 2 × estimate − median replicate, is in the CSV column `bias_corrected` (main "
                f"tables). {ABOVE_MARK}: the same, above.")


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write text atomically (temporary name in the same folder, then rename)."""
    return write_text_atomic(path, text)


def write_csv(df: pl.DataFrame, path: str | os.PathLike) -> Path:
    """Write a DataFrame as CSV atomically."""
    with atomic_path(path) as tmp:
        df.write_csv(tmp)
    return Path(path)


def write_item(out: Path, stem: str, df: pl.DataFrame, markdown: str, latex: str) -> list[Path]:
    """`stem.csv`, `stem.md`, `stem.tex` under `out`; returns the paths."""
    return [write_csv(df, out / f"{stem}.csv"), write_text(out / f"{stem}.md", markdown),
            write_text(out / f"{stem}.tex", latex)]


def fmt(v, decimals: int = 2, signed: bool = False) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return DASH
    return f"{v:+.{decimals}f}" if signed else f"{v:.{decimals}f}"


def tex_escape(s: str) -> str:
    """Escape LaTeX specials of plain labels (dataset keys, method names) and map a few Unicode marks."""
    for a, b in (("&", r"\&"), ("%", r"\%"), ("_", r"\_"), ("#", r"\#"), ("$", r"\$")):
        s = s.replace(a, b)
    for a, b in (("–", "--"), ("−", "$-$"), ("†", r"$^\dagger$"), ("‡", r"$^\ddagger$"), ("λ", r"$\lambda$"),
                 ("Δ", r"$\Delta$"), ("ρ", r"$\rho$"), ("→", r"$\to$"),
                 ("↓", r"$\downarrow$"), ("↑", r"$\uparrow$"), ("§", r"\S{}"), ("×", r"$\times$")):
        s = s.replace(a, b)
    return s


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str | None = None) -> str:
    align = align or ("l" + "r" * (len(header) - 1))
    sep = ["---:" if a == "r" else ":---:" if a == "c" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def tex_tabular(header: Sequence[str], rows: Sequence[Sequence[str] | None], align: str | None = None,
                top: str = "") -> str:
    """booktabs tabular; a `None` row is a \\midrule. Cells are used as given (escape before)."""
    align = align or ("l" + "r" * (len(header) - 1))
    out = [f"\\begin{{tabular}}{{{align}}}", "\\toprule"]
    if top:
        out.append(top)
    out.append(" & ".join(header) + r" \\")
    out.append("\\midrule")
    for r in rows:
        out.append("\\midrule" if r is None else " & ".join(r) + r" \\")
    out += ["\\bottomrule", "\\end{tabular}"]
    return "\n".join(out) + "\n"


def simple_markdown(df: pl.DataFrame, columns: dict[str, str], formats: dict[str, Callable] | None = None,
                    bold: dict[str, str] | None = None) -> str:
    """Markdown of selected columns: {column: header}; formats {column: fn(value) -> str}; bold {column: flag col}."""
    formats, bold = formats or {}, bold or {}
    rows = []
    for r in df.iter_rows(named=True):
        cells = []
        for c in columns:
            s = formats.get(c, _default_fmt)(r[c])
            if c in bold and r[bold[c]]:
                s = f"**{s}**"
            cells.append(s)
        rows.append(cells)
    return md_table(list(columns.values()), rows, _align(df, columns))


def _align(df: pl.DataFrame, columns: dict[str, str]) -> str:
    """Text columns left, numbers right."""
    return "".join("l" if df.schema[c] == pl.Utf8 else "r" for c in columns)


def simple_latex(df: pl.DataFrame, columns: dict[str, str], formats: dict[str, Callable] | None = None,
                 bold: dict[str, str] | None = None, caption: str = "", midrule_on: str | None = None) -> str:
    formats, bold = formats or {}, bold or {}
    rows: list[list[str] | None] = []
    prev = None
    for r in df.iter_rows(named=True):
        if midrule_on and prev is not None and r[midrule_on] != prev:
            rows.append(None)
        prev = r[midrule_on] if midrule_on else None
        cells = []
        for c in columns:
            s = tex_escape(formats.get(c, _default_fmt)(r[c]))
            if c in bold and r[bold[c]]:
                s = f"\\textbf{{{s}}}"
            cells.append(s)
        rows.append(cells)
    body = tex_tabular([tex_escape(h) for h in columns.values()], rows, _align(df, columns))
    return _wrap_table(body, caption)


def _wrap_table(body: str, caption: str) -> str:
    cap = f"\\caption{{{tex_escape(caption)}}}\n" if caption else ""
    return "\\begin{table}[t]\n\\centering\n\\small\n" + body + cap + "\\end{table}\n"


def _default_fmt(v) -> str:
    if isinstance(v, float):
        return fmt(v)
    if v is None:
        return DASH
    return str(v)


# ---------------------------------------------------------------------------------------------------------------
# main tables (Tables 2 and 3)
# ---------------------------------------------------------------------------------------------------------------


def _main_rows(main: pl.DataFrame, group: str | None, cell: Callable[[dict], str]) -> tuple[list[str], list]:
    part = main if group is None else main.filter(pl.col("group") == group)
    cols = part.select("col_pos", "column_label").unique().sort("col_pos")
    labels = cols["column_label"].to_list()
    positions = cols["col_pos"].to_list()
    out = []
    prev_block = None
    for (bpos, rpos), rows in part.group_by(["block_pos", "row_pos"], maintain_order=True):
        rows = {r["col_pos"]: r for r in rows.iter_rows(named=True)}
        first = next(iter(rows.values()))
        block_cell = first["block_label"] if first["block"] != prev_block else ""
        if first["block"] != prev_block and prev_block is not None:
            out.append(None)
        prev_block = first["block"]
        metric = "Acc." if first["metric"] == "accuracy" else "ECE"
        row_label = first["row_label"] if first["row"] not in ("acc", "ece") else ""
        out.append((block_cell, row_label, metric, [cell(rows[p]) if p in rows else DASH for p in positions]))
    return labels, out


def cell_marks(r: dict) -> str:
    """Marks after a main-table value: ‡ (temperature scaling scored on its own fitting data, or an average that
    includes such a cell), § (a partial run, or an average including one) and `(n/m)` on an average over n of the
    group's m datasets."""
    text = (IN_SAMPLE_MARK if r.get("in_sample") else "") + (PARTIAL_MARK if r.get("partial") else "")
    n, m = r.get("n_datasets"), r.get("group_size")
    if r.get("dataset") == "avg" and r.get("value") is not None and n is not None and m is not None and n < m:
        text += f" ({n}/{m})"
    return text


def interval_text(value, lo, hi, signed: bool = False) -> str:
    """`[lo, hi]`, followed by BELOW_MARK (ABOVE_MARK) when the interval lies wholly below (above) `value`."""
    mark = "" if value is None or lo is None else BELOW_MARK if hi < value else ABOVE_MARK if lo > value else ""
    return f"[{fmt(lo, signed=signed)}, {fmt(hi, signed=signed)}]{mark}"


def excludes_estimate(df: pl.DataFrame) -> bool:
    """Whether any interval of a table (columns value, ci_low, ci_high) lies wholly below or above its value."""
    if not {"value", "ci_low", "ci_high"} <= set(df.columns):
        return False
    return df.filter(pl.col("ci_low").is_not_null() & ((pl.col("ci_high") < pl.col("value"))
                                                       | (pl.col("ci_low") > pl.col("value")))).height > 0


def marks_legend(main: pl.DataFrame, intervals: bool = True) -> list[str]:
    """The footnotes of the marks `cell_marks` and (`intervals`: the table shows them) `interval_text` put in this
    table (none when no cell carries one)."""
    notes = []
    if "in_sample" in main.columns and main["in_sample"].any():
        notes.append(f"{IN_SAMPLE_MARK} temperature scaling fitted on this dataset's own labelled logits, so scored "
                     f"on its fitting data (in-sample); an Avg. marked {IN_SAMPLE_MARK} includes such a cell. Neither "
                     "is ever bold: an in-sample ECE is not a held-out result.")
    if "group_size" in main.columns and main.filter(
            (pl.col("dataset") == "avg") & pl.col("value").is_not_null()
            & (pl.col("n_datasets") < pl.col("group_size"))).height:
        notes.append("Avg. (n/m): the average covers only n of the group's m datasets.")
    if intervals and excludes_estimate(main):
        notes.append(BELOW_LEGEND)
    partial = partial_legend(main)
    if partial:
        notes.append(partial)
    return notes


def with_partial_label(df: pl.DataFrame, col: str = "method") -> pl.DataFrame:
    """`df` plus the text column `_label`: the method's display name (`layout.method_label`), with PARTIAL_MARK
    where the row's `partial` is set; the column the Markdown/LaTeX show instead of the key."""
    labels = [layout.method_label(m) + (PARTIAL_MARK if p else "")
              for m, p in zip(df[col], df["partial"] if "partial" in df.columns else [None] * df.height)]
    return df.with_columns(pl.Series("_label", labels, dtype=pl.Utf8))


def partial_legend(df: pl.DataFrame, label: str = "block_label") -> str:
    """The footnote of PARTIAL_MARK: every partial run of a table with its count, from the rows' `partial` column
    (per dataset rows; `label` names the method); "" when no row is partial."""
    if "partial" not in df.columns:
        return ""
    rows = df.filter(pl.col("partial").is_not_null())
    if "dataset" in rows.columns:
        rows = rows.filter(pl.col("dataset") != "avg")
    if not rows.height:
        return ""
    where = next((c for c in ("column_label", "dataset") if c in rows.columns), None)
    runs = rows.select(label, *([where] if where else []), "partial").unique(maintain_order=True)
    listed = "; ".join(f"{r[label].rstrip(PARTIAL_MARK)}" + (f" on {r[where]}" if where else "")
                       + f": {r['partial']} samples" for r in runs.iter_rows(named=True))
    return (f"{PARTIAL_MARK} a partial run, calibrated with --allow-partial (fewer samples than its test set, an "
            f"interrupted or --limit run; an Avg. marked {PARTIAL_MARK} includes one): {listed}.")


def _md_cell(r: dict) -> str:
    """`value` (bold when best) and its marks, with `± std over seeds` when several seeds were averaged."""
    text = (f"**{fmt(r['value'])}**" if r["bold"] else fmt(r["value"])) + cell_marks(r)
    if r.get("seed_std") is not None and (r.get("n_seeds") or 0) > 1:
        text += f" ± {fmt(r['seed_std'])}"
    return text


def main_markdown(main: pl.DataFrame, title: str) -> str:
    """One Markdown table per dataset group (like the paper's Tables 2 and 3), best ECE per block in bold."""
    parts = [f"# {title}\n", "Accuracy and ECE in percent; the best ECE within each TTA block in **bold**; "
             "Avg. is the unweighted macro-average over the group's datasets; ± is the standard deviation over seeds "
             "where several were run.\n", *(f"{n}\n" for n in marks_legend(main, intervals=False))]
    for group in main["group"].unique(maintain_order=True).to_list():
        labels, rows = _main_rows(main, group, _md_cell)
        body = [[f"{b} {rl}".strip() if rl else b, m, *cells] for item in rows if item is not None
                for b, rl, m, cells in [item]]
        parts.append(f"## {layout.GROUP_LABELS.get(group, group)}\n")
        parts.append(md_table(["Method", "Metric", *labels], body, "ll" + "r" * len(labels)))
    return "\n".join(parts)


def main_latex(main: pl.DataFrame, caption: str) -> str:
    """One LaTeX table with grouped dataset columns (\\multicolumn group headers), bold best ECE per block."""
    groups = main["group"].unique(maintain_order=True).to_list()
    labels, rows = _main_rows(main, None, lambda r: (f"\\textbf{{{fmt(r['value'])}}}" if r["bold"]
                                                     else tex_escape(fmt(r["value"]))) + tex_escape(cell_marks(r)))
    caption = " ".join([caption, *marks_legend(main, intervals=False)])
    spans = [main.filter(pl.col("group") == g).select("col_pos").unique().height for g in groups]
    top = " & ".join(["", ""] + [f"\\multicolumn{{{n}}}{{c}}{{{tex_escape(layout.GROUP_LABELS.get(g, g))}}}"
                                 for g, n in zip(groups, spans)]) + r" \\"
    start = 3
    rules = []
    for n in spans:
        rules.append(f"\\cmidrule(lr){{{start}-{start + n - 1}}}")
        start += n
    top += "\n" + "".join(rules)
    body_rows: list[list[str] | None] = []
    for item in rows:
        if item is None:
            body_rows.append(None)
            continue
        b, rl, m, cells = item
        first = r"\quad " + tex_escape(rl) if rl else tex_escape(b)
        body_rows.append([first, m, *cells])
    header = [r"\textbf{Method}", r"\textbf{Metric}", *[f"\\textbf{{{tex_escape(x)}}}" for x in labels]]
    body = tex_tabular(header, body_rows, "l|l|" + "c" * len(labels), top=top)
    return "\\begin{table*}[t]\n\\centering\n\\small\n\\setlength{\\tabcolsep}{3.5pt}\n" + body + \
        f"\\caption{{{tex_escape(caption)}}}\n\\end{{table*}}\n"


def intervals_markdown(intervals: pl.DataFrame, diffs: pl.DataFrame, title: str, n_resamples: int, level: float) -> str:
    """Companion of a main table: each ECE with its interval, then ZAEC-minus-baseline differences."""
    pct = int(round(level * 100))
    parts = [f"# {title}\n",
             f"Paired bootstrap over samples ({n_resamples} resamples; zero-shot, raw and calibrated predictions "
             f"resampled together); {pct}% basic bootstrap intervals (2 x estimate minus the replicate quantiles, "
             "which undoes ECE's upward resampling bias; ECE floored at 0), ECE in percent. Avg. intervals average the "
             "per-dataset replicates (datasets resampled independently).\n",
             *(f"{n}\n" for n in marks_legend(intervals))]
    for group in intervals["group"].unique(maintain_order=True).to_list():
        labels, rows = _main_rows(intervals.with_columns(pl.lit("ece").alias("metric")), group,
                                  lambda r: f"{fmt(r['value'])}{cell_marks(r)} "
                                  f"{interval_text(r['value'], r['ci_low'], r['ci_high'])}" if r["ci_low"] is not None
                                  else fmt(r["value"]) + cell_marks(r))
        body = [[f"{b} {rl}".strip() if rl else b, *cells] for item in rows if item is not None
                for b, rl, m, cells in [item]]
        parts.append(f"## ECE with {pct}% intervals: {layout.GROUP_LABELS.get(group, group)}\n")
        parts.append(md_table(["Method", *labels], body))
    if diffs.height:
        parts.append(f"## Differences in ECE (percentage points), {pct}% paired intervals\n")
        parts.append(f"Negative: ZAEC lower. {NS_MARK} the interval contains zero (no difference claimed)."
                     + (f" {IN_SAMPLE_MARK} against temperature scaling scored on its own fitting data."
                        if "in_sample" in diffs.columns and diffs["in_sample"].any() else "") + "\n")
        for group in diffs["group"].unique(maintain_order=True).to_list():
            d = diffs.filter(pl.col("group") == group)
            cols = d.select("col_pos", "column_label").unique().sort("col_pos")
            body = []
            for (m, comp), part in d.group_by(["method", "comparison"], maintain_order=True):
                cells = {r["col_pos"]: r for r in part.iter_rows(named=True)}
                row = [f"{layout.method_label(m)}: {comp}"]
                for p in cols["col_pos"]:
                    r = cells.get(p)
                    if r is None:
                        row.append(DASH)
                    elif r["ci_low"] is None:
                        row.append(fmt(r["estimate"], signed=True) + (IN_SAMPLE_MARK if r.get("in_sample") else "")
                                   + (PARTIAL_MARK if r.get("partial") else ""))
                    else:
                        mark = (NS_MARK if r["contains_zero"] else "") + (IN_SAMPLE_MARK if r.get("in_sample") else "") \
                            + (PARTIAL_MARK if r.get("partial") else "")
                        row.append(f"{fmt(r['estimate'], signed=True)}{mark} "
                                   f"[{fmt(r['ci_low'], signed=True)}, {fmt(r['ci_high'], signed=True)}]")
                body.append(row)
            parts.append(f"### {layout.GROUP_LABELS.get(group, group)}\n")
            parts.append(md_table(["Comparison", *cols["column_label"].to_list()], body))
    return "\n".join(parts)


def intervals_latex(diffs: pl.DataFrame, caption: str) -> str:
    """LaTeX of the differences (estimate with interval; dagger where it contains zero), one row per comparison."""
    cols = diffs.select("col_pos", "column_label", "group").unique().sort("col_pos")
    rows: list[list[str] | None] = []
    prev = None
    for (m, comp), part in diffs.group_by(["method", "comparison"], maintain_order=True):
        if prev is not None and m != prev:
            rows.append(None)
        prev = m
        cells = {r["col_pos"]: r for r in part.iter_rows(named=True)}
        row = [tex_escape(f"{layout.method_label(m)}: {comp}")]
        for p in cols["col_pos"]:
            r = cells.get(p)
            if r is None:
                row.append("--")
            else:
                mark = (r"$^\dagger$" if r["contains_zero"] else "") + (r"$^\ddagger$" if r.get("in_sample") else "") \
                    + (r"\S{}" if r.get("partial") else "")
                ci = "" if r["ci_low"] is None else \
                    f" [{fmt(r['ci_low'], signed=True)}, {fmt(r['ci_high'], signed=True)}]"
                row.append(f"{fmt(r['estimate'], signed=True)}{mark}{ci}")
        rows.append(row)
    header = ["Comparison", *[tex_escape(x) for x in cols["column_label"].to_list()]]
    return _wrap_table(tex_tabular(header, rows, "l" + "c" * cols.height), caption)


def main_rich(main: pl.DataFrame, title: str):
    """A rich Table of a main table (all groups side by side; bold best ECE per block) for the terminal."""
    from rich.table import Table

    labels, rows = _main_rows(main, None, lambda r: (f"[bold]{fmt(r['value'])}[/bold]" if r["bold"]
                                                     else fmt(r["value"])) + cell_marks(r))
    table = Table(title=title)
    table.add_column("Method")
    table.add_column("Metric")
    for lab in labels:
        table.add_column(lab, justify="right")
    for item in rows:
        if item is None:
            table.add_section()
            continue
        b, rl, m, cells = item
        table.add_row(rl if rl else b, m, *cells)
    return table


# ---------------------------------------------------------------------------------------------------------------
# the trust table (beyond the paper): selective prediction and classwise calibration
# ---------------------------------------------------------------------------------------------------------------


def _trust_value_cell(r: dict) -> str:
    """`value [low, high]` with the main table's marks; a missing value is a dash."""
    if r["value"] is None:
        return DASH
    ci = "" if r["ci_low"] is None else " " + interval_text(r["value"], r["ci_low"], r["ci_high"])
    return fmt(r["value"]) + cell_marks(r) + ci


def _trust_diff_cell(r: dict) -> str:
    """`+1.23† [low, high]`: the difference, † where its interval contains zero."""
    if r["estimate"] is None:
        return DASH
    mark = (NS_MARK if r["contains_zero"] else "") + (PARTIAL_MARK if r.get("partial") else "")
    ci = "" if r["ci_low"] is None else f" [{fmt(r['ci_low'], signed=True)}, {fmt(r['ci_high'], signed=True)}]"
    return fmt(r["estimate"], signed=True) + mark + ci


def _pivot(df: pl.DataFrame, keys: Sequence[str], label: Callable[[dict], list[str]], metrics: Sequence[str],
           cell: Callable[[dict], str]) -> list[list[str]]:
    """One row per distinct `keys` (in order), one cell per metric (dash where absent)."""
    rows = []
    for _, part in df.group_by(list(keys), maintain_order=True):
        by_metric = {r["metric"]: r for r in part.iter_rows(named=True)}
        first = part.row(0, named=True)
        rows.append([*label(first), *[cell(by_metric[m]) if m in by_metric else DASH for m in metrics]])
    return rows


def trust_sections(table: pl.DataFrame, diffs: pl.DataFrame, metric_sets: Sequence[tuple[str, Sequence[str]]]):
    """(group, heading, header, rows) of every table the trust item shows: per dataset group and metric set, the
    group averages per row, then ZAEC minus each baseline."""
    labels = dict(zip(table["metric"], table["metric_label"]))
    avg, davg = table.filter(pl.col("dataset") == "avg"), diffs.filter(pl.col("dataset") == "avg")
    out = []
    for group in avg["group"].unique(maintain_order=True).to_list():
        g, dg = avg.filter(pl.col("group") == group), davg.filter(pl.col("group") == group)
        for name, metrics in metric_sets:
            header = [labels.get(m, m) for m in metrics]
            out.append((group, name, ["Method", "Calibrator", *header], _pivot(
                g.sort("row_pos"), ["row_pos"], lambda r: [r["block_label"], r["row_label"]], metrics,
                _trust_value_cell)))
            if dg.height:
                out.append((group, f"{name}: differences (points)", ["Method", "Difference", *header], _pivot(
                    dg, ["method", "comparison"], lambda r: [layout.method_label(r["method"]), r["comparison"]],
                    metrics, _trust_diff_cell)))
    return out


def trust_markdown(sections, title: str, preamble: str) -> str:
    """The trust item's Markdown: title, preamble, then one table per section of `trust_sections`."""
    parts = [f"# {title}\n", preamble + "\n"]
    for group, name, header, rows in sections:
        parts.append(f"## {layout.GROUP_LABELS.get(group, group)}: {name}\n")
        parts.append(md_table(header, rows, "ll" + "r" * (len(header) - 2)))
    return "\n".join(parts)


def trust_latex(sections, caption: str) -> str:
    """The trust item's LaTeX: one booktabs table per section, the caption on the first."""
    out = []
    for i, (group, name, header, rows) in enumerate(sections):
        body = tex_tabular([tex_escape(h) for h in header], [[tex_escape(c) for c in r] for r in rows],
                           "ll" + "r" * (len(header) - 2))
        text = f"{layout.GROUP_LABELS.get(group, group)}: {name}." + (f" {caption}" if i == 0 else "")
        out.append(_wrap_table(body, text))
    return "".join(out)
