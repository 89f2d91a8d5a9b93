"""Results pages (issue 43): index.html rendered from the report's own tables and plots, parsed as a browser would:
one <table> per report table, each inside a scrolling box, every plot captioned with its n, every source on disk,
no external URL; and a cell of the page equals the run record it came from."""

from __future__ import annotations

import csv
import statistics
from html.parser import HTMLParser
from pathlib import Path

import pytest

from distlion.report import Table, write_report
from distlion.train import run


class Page(HTMLParser):
    """The parts of a page the tests read: tables (rows of cell texts, and whether each sits in a scrolling box),
    images, figure captions, scripts, links."""

    def __init__(self, text: str):
        super().__init__()
        self.tables: list[dict] = []
        self.images: list[str] = []
        self.captions: list[str] = []
        self.sources: list[str] = []  # every src= and href=
        self._stack: list[tuple[str, dict]] = []
        self._cell: list[str] | None = None
        self._caption: list[str] | None = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self._stack.append((tag, attrs))
        for key in ("src", "href"):
            if attrs.get(key):
                self.sources.append(attrs[key])
        if tag == "table":
            boxed = any(t == "div" and "scroll" in (a.get("class") or "").split() for t, a in self._stack[:-1])
            self.tables.append({"rows": [], "scrolls": boxed})
        elif tag == "tr" and self.tables:
            self.tables[-1]["rows"].append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "img":
            self.images.append(attrs.get("src", ""))
        elif tag == "figcaption":
            self._caption = []

    def handle_endtag(self, tag):
        while self._stack and self._stack.pop()[0] != tag:
            pass
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1]["rows"][-1].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "figcaption" and self._caption is not None:
            self.captions.append("".join(self._caption).strip())
            self._caption = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)
        if self._caption is not None:
            self._caption.append(data)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """A small digits sweep: G-AdamW and D-Lion MaVo at 2 workers, 2 seeds, a few steps."""
    from hydra import compose, initialize_config_dir

    root = tmp_path_factory.mktemp("sweep")
    conf = str(Path(__file__).resolve().parent.parent / "conf")
    for method in ("adamw", "dlion"):
        for seed in (0, 1):
            with initialize_config_dir(config_dir=conf, version_base="1.3"):
                cfg = compose("config", overrides=["logger=none", "train.progress=false", "task=digits",
                                                   f"method={method}", f"seed={seed}", "train.steps=6",
                                                   "cluster.workers=2", "cluster.per_worker_batch=8"])
            run(cfg, root / "runs" / f"{method}-{seed}")
    (root / "results").mkdir()
    (root / "results" / "README.md").write_text("# The reading\n\nD-Lion is **level** here.\n")
    write_report(root / "runs", root / "results", "distlion-experiment t.yaml", columns="workers")
    return root


def test_the_page_has_the_reports_tables_in_scrolling_boxes_and_captioned_plots(sweep, monkeypatch):
    made = []
    original = Table.markdown
    monkeypatch.setattr(Table, "markdown", lambda self: made.append(self) or original(self))
    write_report(sweep / "runs", sweep / "again", "cmd", columns="workers")
    page = Page((sweep / "again" / "index.html").read_text())
    assert len(page.tables) == len(made) >= 4  # pivot, main, paired, step times, hyperparameters...
    assert all(t["scrolls"] for t in page.tables)
    assert len(page.captions) == len(page.images) + 1 >= 6  # every plot, and the interactive chart
    for caption in page.captions:
        assert "n = 2 seeds per group" in caption, caption
    for source in page.sources:
        assert "://" not in source and not source.startswith("//"), source  # opens offline
        assert (sweep / "again" / source).is_file(), source


def test_a_cell_of_the_page_is_the_number_of_its_run_record(sweep):
    page = Page((sweep / "results" / "index.html").read_text())
    rows = list(csv.DictReader((sweep / "results" / "runs.csv").open()))
    main = next(t for t in page.tables if t["rows"][0][:3] == ["method", "workers", "per-worker batch"])
    header = main["rows"][0]
    adamw = next(r for r in main["rows"] if r[0] == "G-AdamW")
    accuracies = sorted(100 * float(r["test_accuracy"]) for r in rows if r["method"] == "adamw")
    expected = f"{statistics.mean(accuracies):.2f} ± {statistics.stdev(accuracies):.2f}"
    assert adamw[header.index("test accuracy (%)")] == expected
    text = (sweep / "results" / "index.html").read_text()
    assert '<td class="r">' + expected + "</td>" in text  # a number: right-aligned
    assert "D-Lion is <strong>level</strong> here." in text  # the README's reading beside the tables
    assert "distlion-experiment t.yaml" in text and "Provenance: 4 runs" in text


def test_the_interactive_chart_hovers_each_groups_settings_mean_std_and_n(sweep):
    text = (sweep / "results" / "index.html").read_text()
    page = Page(text)
    assert "../assets/plotly.min.js" in page.sources and (sweep / "assets" / "plotly.min.js").stat().st_size > 1e6
    rows = list(csv.DictReader((sweep / "results" / "runs.csv").open()))
    for method, label in (("adamw", "G-AdamW"), ("dlion", "D-Lion (MaVo)")):
        accuracies = [100 * float(r["test_accuracy"]) for r in rows if r["method"] == method]
        shown = f"{statistics.mean(accuracies):.2f} \\u00b1 {statistics.stdev(accuracies):.2f}"  # JSON's ±
        assert f'["{label}","{shown}",2]' in text, (label, shown)  # settings, mean ± std, n
    assert "hover a point for its settings, mean ± std and n" in text


def test_the_index_links_every_experiment_with_its_headline_and_figure(sweep):
    from distlion.pages import render_index

    page = Page(render_index(sweep).read_text())
    assert "results/index.html" in page.sources and "again/index.html" in page.sources
    for source in page.sources:
        assert (sweep / source).is_file() and "://" not in source, source
    assert "results/metric_vs_bits_per_iter.png" in page.images
    assert "The reading" in (sweep / "index.html").read_text()  # the README's title is the headline


def test_a_spec_with_links_also_charts_accuracy_against_modelled_time(sweep):
    from distlion.wallclock import modelled_points

    write_report(sweep / "runs", sweep / "linked", "cmd", links=["100mbit"])
    text = (sweep / "linked" / "index.html").read_text()
    assert 'id="accuracy-vs-time-100mbit"' in text and "modelled training time on 100mbit links (s)" in text
    points = {p["method"]: p for p in modelled_points(report_runs(sweep), "100mbit")}
    # G-AdamW's 64 bits per parameter per step cost more modelled time on the slow link than MaVo's 2
    assert points["G-AdamW"]["x"] > points["D-Lion (MaVo)"]["x"] > 0 and points["G-AdamW"]["n"] == 2


def report_runs(sweep: Path) -> list[dict]:
    from distlion.report import load_runs

    return load_runs(sweep / "runs")
