"""Results as a page a researcher opens: `results/<spec>/index.html`, rendered from the report's own tables and
plots (`distlion.report.Table`, `Figure`), not from its markdown text.

Real HTML tables (numbers right-aligned, a wide table scrolling inside its box), every plot with a caption that
says what it shows and over how many seeds, the command and provenance the report states, and the spec's README
(its reading of the numbers) beside them. One small stylesheet in the page and no external URL: it opens offline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jinja2 import Environment
from markdown_it import MarkdownIt

_MD = MarkdownIt("commonmark", {"html": False}).enable("table")  # raw HTML in the text is escaped, never passed

STYLE = """
body { font-family: system-ui, sans-serif; margin: 0 auto; max-width: 1500px; padding: 1em 2em; color: #222; }
.layout { display: grid; grid-template-columns: minmax(0, 3fr) minmax(0, 2fr); gap: 2.5em; }
@media (max-width: 1100px) { .layout { grid-template-columns: minmax(0, 1fr); } }
.scroll { overflow-x: auto; margin: 0.5em 0 1.5em; border: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.85em; }
th, td { padding: 0.25em 0.6em; border-bottom: 1px solid #eee; white-space: nowrap; }
th { background: #f4f4f4; position: sticky; top: 0; }
td.r, th.r { text-align: right; font-variant-numeric: tabular-nums; }
td.l, th.l { text-align: left; }
tr:hover td { background: #f9f9ff; }
figure { margin: 1em 0 2em; }
figure img { max-width: 100%; }
figcaption { font-size: 0.85em; color: #555; }
aside { font-size: 0.92em; line-height: 1.45; }
aside img { max-width: 100%; }
code { background: #f4f4f4; padding: 0 0.2em; }
pre { overflow-x: auto; background: #f7f7f7; padding: 0.6em; }
p.intro { font-size: 0.9em; color: #333; }
"""

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{{ title }}</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{{ style }}</style>
{% if charts %}<script src="../{{ plotly }}"></script>{% endif %}</head>
<body><h1>{{ title }}</h1>
<div class="layout"><main>
{% for block in blocks %}
{% if block.kind == "table" %}
{% if block.intro %}<p class="intro">{{ block.intro }}</p>{% endif %}
<div class="scroll"><table>
<thead><tr>{% for cell, align in block.header %}<th class="{{ align }}">{{ cell }}</th>{% endfor %}</tr></thead>
<tbody>{% for row in block.rows %}<tr>
{% for cell, align in row %}<td class="{{ align }}">{{ cell }}</td>{% endfor %}</tr>{% endfor %}
</tbody></table></div>
{% for note in block.notes %}<p class="intro">{{ note }}</p>{% endfor %}
{% elif block.kind == "charts" %}
{% for caption, chart in charts %}<figure>{{ chart }}<figcaption>{{ caption }}</figcaption></figure>{% endfor %}
{% elif block.kind == "figure" %}
<figure><img src="{{ block.path }}" alt="{{ block.caption|striptags }}">
<figcaption>{{ block.caption }}</figcaption></figure>
{% else %}
{{ block.html }}
{% endif %}
{% endfor %}
</main>
{% if readme %}<aside><h2>Reading (README.md)</h2>{{ readme }}</aside>{% endif %}
</div></body></html>
"""

@dataclass
class Table:
    """One table of a report: the sentence(s) before it, its header and rows, and notes after it. `results.md` and
    `index.html` are both written from these cells (`markdown`, `distlion.pages`). `align`: one letter per column,
    l (text) or r (numbers); by default the first column is text and the others numbers."""

    header: list[str]
    rows: list[list[Any]]
    intro: str = ""
    notes: list[str] = field(default_factory=list)
    align: str = ""

    @property
    def alignment(self) -> str:
        return self.align or "l" + "r" * (len(self.header) - 1)

    def markdown(self) -> str:
        rule = "|" + "".join("---|" if a == "l" else "---:|" for a in self.alignment)
        lines = ["| " + " | ".join(self.header) + " |", rule, *("| " + " | ".join(str(c) for c in row) + " |"
                                                              for row in self.rows)]
        intro = self.intro.strip() + "\n\n" if self.intro else ""
        return intro + "\n".join(lines) + "\n" + "".join(f"\n{note}\n" for note in self.notes)

    def __str__(self) -> str:
        return self.markdown()


@dataclass
class Figure:
    """A plot of a report and its caption: what it shows and over how many seeds."""

    path: str
    caption: str

    def __str__(self) -> str:
        return f"![{self.caption}]({self.path})\n"


_ENV = Environment(autoescape=False)  # every text reaches the template already escaped (markdown-it, below)


def _inline(text: Any) -> str:
    """A cell or sentence: its markdown (`code`, **bold**) as HTML, anything else escaped."""
    return _MD.renderInline(str(text))


def _block(block: Any) -> dict[str, Any]:
    if isinstance(block, Table):
        align = block.alignment
        return {"kind": "table", "intro": _inline(block.intro.strip()) if block.intro else "",
                "header": [(_inline(h), a) for h, a in zip(block.header, align)],
                "rows": [[(_inline(c), a) for c, a in zip(row, align)] for row in block.rows],
                "notes": [_inline(n) for n in block.notes]}
    if isinstance(block, Figure):
        return {"kind": "figure", "path": block.path, "caption": _inline(block.caption)}
    return {"kind": "text", "html": _MD.render(str(block))}


def render_page(title: str, blocks: list[Any], path: Path, readme: Path | None = None,
                charts: list[tuple[str, str]] = ()) -> None:
    """index.html at `path` from the report's blocks (markdown text, `Table`, `Figure`), interactive `charts`
    ((caption, html of `interactive_chart`): plotly.js is written once beside the result folders) and the README
    beside them."""
    text = readme.read_text() if readme is not None and readme.is_file() else ""
    if charts:
        write_plotly(path.parent.parent)
    shown = [_block(b) for b in blocks]
    if charts:  # the interactive chart right after the first table: the headline, then how it was bought in bits
        first = next((i for i, b in enumerate(shown) if b["kind"] == "table"), len(shown) - 1)
        shown.insert(first + 1, {"kind": "charts"})
    page = _ENV.from_string(PAGE).render(title=_inline(title), style=STYLE, blocks=shown,
                                         readme=_MD.render(text) if text else "", plotly=PLOTLY_JS,
                                         charts=[(_inline(c), html) for c, html in charts])
    path.write_text(page)


# The interactive charts' library, written once beside the result folders (`results/assets/`), never from a CDN.
PLOTLY_JS = "assets/plotly.min.js"


def write_plotly(root: Path) -> Path:
    """plotly.js under `root` (the folder holding the result folders), once: the pages load it from there offline."""
    import plotly.offline

    path = root / PLOTLY_JS
    text = plotly.offline.get_plotlyjs()
    if not path.is_file() or path.stat().st_size != len(text.encode()):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return path


# matplotlib's tab10, in the same method order as the report's static plots, so a method keeps its colour.
TAB10 = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


def interactive_chart(points: list[dict[str, Any]], x_title: str, y_title: str, chart_id: str) -> str:
    """A plotly scatter of group means with ±1 std bars, one trace per method; hovering a point shows the group's
    settings, mean ± std and n. `points`: {method, settings, x, y, std, n, shown} per group."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for i, method in enumerate(dict.fromkeys(p["method"] for p in points)):
        mine = [p for p in points if p["method"] == method]
        fig.add_trace(go.Scatter(
            x=[p["x"] for p in mine], y=[p["y"] for p in mine], mode="markers", name=method,
            marker={"color": TAB10[i % len(TAB10)], "size": 9},
            error_y={"type": "data", "array": [p["std"] for p in mine], "visible": True},
            customdata=[[p["settings"], p["shown"], p["n"]] for p in mine],
            hovertemplate="<b>%{customdata[0]}</b><br>" + y_title + ": %{customdata[1]} (n=%{customdata[2]})"
                          "<br>" + x_title + ": %{x:.3g}<extra></extra>"))
    fig.update_layout(xaxis={"title": x_title, "type": "log"}, yaxis={"title": y_title}, height=460,
                      margin={"l": 60, "r": 20, "t": 30, "b": 50}, template="plotly_white")
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=chart_id)


INDEX = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>distlion results</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{{ style }}
.cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(340px, 1fr)); gap: 1.5em; }
.card { border: 1px solid #ddd; padding: 0.8em; } .card h2 { font-size: 1.05em; }
.card img { width: 100%; max-height: 280px; object-fit: contain; }
</style></head><body><h1>distlion results</h1>
<p>Every experiment of <code>results/</code>: its headline and its accuracy-against-bits figure. Made by
<code>{{ command }}</code>.</p>
<div class="cards">{% for e in experiments %}
<div class="card"><h2><a href="{{ e.name }}/index.html">{{ e.name }}</a></h2><p>{{ e.headline }}</p>
{% if e.thumbnail %}<a href="{{ e.name }}/index.html"><img src="{{ e.name }}/{{ e.thumbnail }}"
alt="accuracy against bits, {{ e.name }}"></a>{% endif %}</div>{% endfor %}
</div></body></html>
"""


def _headline(folder: Path) -> str:
    """An experiment's one-line headline: its README's title, else its report's first line of description."""
    for name in ("README.md", "results.md"):
        path = folder / name
        if path.is_file():
            lines = [line.strip() for line in path.read_text().splitlines() if line.strip()]
            if name == "README.md" and lines:
                return lines[0].lstrip("#").strip()
            if len(lines) > 1:
                return lines[1]
    return ""


def render_index(root: Path, command: str = "distlion-report --index results/") -> Path:
    """`root`/index.html: one card per experiment folder with a page, its headline and thumbnail."""
    experiments = []
    for folder in sorted(p for p in root.iterdir() if (p / "index.html").is_file()):
        thumbnail = next((name for name in ("metric_vs_bits_per_iter.png", "metric_vs_bits.png", "wallclock.png")
                          if (folder / name).is_file()), None)
        experiments.append({"name": folder.name, "headline": _inline(_headline(folder)), "thumbnail": thumbnail})
    path = root / "index.html"
    path.write_text(_ENV.from_string(INDEX).render(style=STYLE, experiments=experiments, command=command))
    return path
