"""How the report's numbers read and how its blocks render: number formats, readable configs
and cases, and the markdown and HTML renderers of the blocks `report_plots.document` builds.
Nothing here decides what a number means."""

from __future__ import annotations

import html
import re

from core.records import TimingHost

NOT_MEANINGFUL = "not meaningful (CPU / Triton interpreter timing): no speedup derived"


# The host's drift between the profile and the timing is told only from this far apart: the
# same host, timed twice minutes apart, differs by a few percent (Llama-3.2-1B b8 on an H100,
# 1.053x, moved its replay 0.2 %).
HOST_DRIFT_SHOWN = 0.05


def host_drift_told(reading: TimingHost | dict | None, families) -> bool:
    """Whether the replay at the timing's host speed (`projection.timing_host_projection`) is
    worth a line: read for the set measured, with the host moved enough to tell."""
    if not reading:
        return False
    reading = TimingHost.of(reading)
    return bool(reading.replay is not None and set(reading.families) == set(families)
                and abs(reading.host_drift - 1) >= HOST_DRIFT_SHOWN)


def speed(v) -> str:
    return "-" if v is None else f"{v:.3f}x"


def pct(v) -> str:
    """A share or an error; one that rounds to zero reads 0.0%, never -0.0% (a rest row of
    1 - sum(shares) comes out at -1e-16)."""
    if v is None:
        return "-"
    return f"{0.0 if round(v * 100, 1) == 0 else v:.1%}"


def ms(v) -> str:
    return "-" if v is None else f"{v:.3f} ms"


def more_rows(n: int) -> str:
    """The label of the row standing for the top-level rows past the table's end."""
    return f"{n} more row{'s' if n > 1 else ''}"


def ci(pair) -> str:
    return "" if not pair else f"[{pair[0]:.3f}x, {pair[1]:.3f}x]"


_TEMPLATE_ARG = re.compile(r"<\s*([A-Za-z_]\w{12,})\s*[,>]")


def kernel_label(name: str, limit: int = 60) -> str:
    """A GPU kernel's name as a reader needs it: a C++ symbol loses its return type,
    namespaces, parameters and template arguments (`void at::native::(anonymous
    namespace)::elementwise_kernel_with_index<int, ...600 characters...>(...)` ->
    `elementwise_kernel_with_index`), but keeps a first template argument that names the
    kernel (`Kernel2<cutlass_80_simt_sgemm_128x32_8x5_nn_align1>`); anything left longer than
    `limit` is cut."""
    text = name.strip().removeprefix("void ").replace("(anonymous namespace)::", "")
    cut = min((i for i in (text.find("<"), text.find("(")) if i >= 0), default=len(text))
    base = text[:cut].rsplit("::", 1)[-1] or text
    arg = _TEMPLATE_ARG.match(text[cut:]) if text[cut:cut + 1] == "<" else None
    label = f"{base}<{arg.group(1)}>" if arg else base
    return label if len(label) <= limit else label[: limit - 1] + "\u2026"


_PARAM_NAMES = {"num_warps": "warps", "num_stages": "stages"}


def config_text(config) -> str:
    """`{'BLOCK': 128, 'num_warps': 4}` -> `BLOCK=128, warps=4`."""
    if not isinstance(config, dict):
        return "-" if config is None else str(config)
    return ", ".join(f"{_PARAM_NAMES.get(k, k)}={v}" for k, v in config.items()) or "default"


def case_text(case, fallback: str = "-") -> str:
    """A case as its shape: `{'rows': 8192, 'hidden': 2048, 'dtype': 'bfloat16', ...}` ->
    `8192 x 2048 (rows x hidden), bfloat16`; other text fields follow (`act silu`)."""
    if not isinstance(case, dict) or not case:
        return fallback
    dims = [(k, v) for k, v in case.items() if isinstance(v, int) and not isinstance(v, bool)]
    words = [f"{k} {v}" for k, v in case.items() if isinstance(v, str) and k != "dtype"]
    shape = (" x ".join(str(v) for _, v in dims) + " (" + " x ".join(k for k, _ in dims) + ")"
             if dims else "")
    return ", ".join(x for x in (shape, case.get("dtype"), *words) if x) or fallback


# Blocks: ("h", level, text) ("p", text) ("note", text) ("table", headers, rows)
# ("img", src, alt) ("ul", items) ("links", [(text, href)]) ("pre", text)


def _cell(v) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


def to_markdown(blocks: list[tuple]) -> str:
    def table(head, rows):
        def line(cells):
            return "| " + " | ".join(_cell(c) for c in cells) + " |"
        return "\n".join([line(head), "|" + "---|" * len(head)] + [line(r) for r in rows])
    fmt = {"h": lambda level, t: "#" * level + " " + t, "p": lambda t: t,
           "note": lambda t: "> **Note:** " + t, "table": table,
           "img": lambda src, alt: f"![{alt}]({src})",
           "ul": lambda items: "\n".join(f"- {i}" for i in items),
           "links": lambda links: "\n".join(f"- [{t}]({h})" for t, h in links),
           "pre": lambda t: "```text\n" + t.rstrip() + "\n```"}
    return "\n\n".join(fmt[b[0]](*b[1:]) for b in blocks) + "\n"


# wide enough for the first screen (1400 x 900) to hold the verdict, the whole-model table and
# the kernels table (benchmarks/report_screen.py); running text keeps a readable measure
CSS = """body{font-family:system-ui,-apple-system,sans-serif;max-width:1320px;margin:1em auto;
padding:0 1em;color:#222;line-height:1.4}h1{font-size:1.6em;margin:.4em 0}
p,.note{max-width:75em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.4em}
table{border-collapse:collapse;margin:.6em 0 1.2em;font-size:.9em}
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#f2f2f2}td{overflow-wrap:anywhere}
td.num{text-align:right;font-variant-numeric:tabular-nums}
img{max-width:100%;border:1px solid #e4e4e4;margin:.4em 0}.note{background:#fff8e1;
border-left:4px solid #f0b400;padding:.5em .8em;margin:.8em 0}pre{background:#f6f8fa;
padding:.8em;white-space:pre-wrap;overflow-wrap:anywhere;font-size:.85em}"""
_NUM = re.compile(r"^[-+]?[\d.]+(e[-+]?\d+)?(x|%| ms| us)?$")


def to_html(blocks: list[tuple], title: str) -> str:
    e = html.escape

    def table(head, rows):
        th = "".join(f"<th>{e(str(h))}</th>" for h in head)
        body = "".join("<tr>" + "".join(f'<td{" class=num" if _NUM.match(str(c)) else ""}>'
                                        f"{e(str(c))}</td>" for c in r) + "</tr>" for r in rows)
        return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"
    fmt = {"h": lambda level, t: f"<h{level}>{e(t)}</h{level}>", "p": lambda t: f"<p>{e(t)}</p>",
           "note": lambda t: f'<div class="note"><b>Note:</b> {e(t)}</div>', "table": table,
           "img": lambda src, alt: f'<img src="{e(src)}" alt="{e(alt)}">',
           "ul": lambda items: "<ul>" + "".join(f"<li>{e(i)}</li>" for i in items) + "</ul>",
           "links": lambda links: "<ul>" + "".join(f'<li><a href="{e(h)}">{e(t)}</a></li>'
                                                   for t, h in links) + "</ul>",
           "pre": lambda t: f"<pre>{e(t)}</pre>"}
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{e(title)}'
            f"</title><style>{CSS}</style></head><body>\n"
            + "\n".join(fmt[b[0]](*b[1:]) for b in blocks) + "\n</body></html>\n")


