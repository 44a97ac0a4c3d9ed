"""``viewer.html``: its data against rank-eval's conventions, bad input, and a headless-Chromium test of the page.

The browser test drives Debian's ``chromium`` over the DevTools protocol on a pipe (``--remote-debugging-pipe``:
JSON messages separated by NUL on fds 3 and 4), so it needs no Python package and no driver; it is skipped where
``chromium`` is absent (install: ``apt-get install chromium``). ``KVDIAG_VIEWER=path/viewer.html`` points it at
another viewer (the committed one) and ``KVDIAG_SCREENSHOT=path.png`` keeps its screenshot.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from kvdiag.core.errors import UserError
from kvdiag.core.io import write_table
from kvdiag.rankeval import KEYS, harm_threshold
from kvdiag.rankeval.metrics import eviction_counts, n_evicted
from kvdiag.report.run import report_files
from kvdiag.report.viewer import ViewerSettings, build_viewer, viewer_data, viewer_html
from tests.conftest import synthetic_labels as shared_synthetic_labels

RULES = ("attention", "rkv", "avokv_e", "streamingllm")


def synthetic_labels(trace, seed: int = 0) -> pl.DataFrame:
    """Two checkpoints per prompt, 30 candidates each; some below the noise floor."""
    return shared_synthetic_labels(trace, seed, back=24, random_flips=True, floor_by_checkpoint=False)


def synthetic_scores(labels: pl.DataFrame, seed: int = 1) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    cols = {n: rng.normal(size=labels.height) for n in RULES}
    cols["streamingllm"] = np.round(cols["streamingllm"])  # ties, some straddling the eviction boundary
    return labels.select(KEYS).with_columns(**{n: pl.Series(v) for n, v in cols.items()})


def page_data(html: str) -> dict:
    return json.loads(html.split('id="kvdiag-data">', 1)[1].split("</script>", 1)[0])


@pytest.fixture(scope="module")
def run(tiny_trace, tmp_path_factory):
    """A run directory with trace, labels, scores and the two figure CSVs the viewer marks; report built."""
    root = tmp_path_factory.mktemp("viewer") / "run"
    shutil.copytree(tiny_trace.path, root / "trace")
    labels = synthetic_labels(tiny_trace)
    scores = synthetic_scores(labels)
    prov = {"trace": tiny_trace.provenance}
    write_table(labels, root / "labels.parquet", {"kind": "labels", **prov})
    write_table(scores, root / "scores.parquet", {"kind": "scores", **prov})
    (root / "figures").mkdir()
    pid, lab0 = tiny_trace.prompt_ids[0], labels.row(0, named=True)
    pl.DataFrame(
        {
            "prompt_id": [pid, pid], "position": [3, 5], "read_class": ["delayed", "early"],
            "first_strong_read": [20, 7], "delay": [17, None], "evicted_before_read": [True, False],
        }
    ).write_csv(root / "figures" / "delayed_reads_entries.csv")
    pl.DataFrame(
        {
            "prompt_id": [pid], "checkpoint": [lab0["checkpoint"]], "position": [lab0["position"]],
            "read_pressure": [0.01], "value_payload": [7.5], "blind_spot": [True],
        }
    ).write_csv(root / "figures" / "blind_spot_points.csv")
    (root / "figures" / "figures.json").write_text(json.dumps({"params": {"harm": "quantile:0.8"}}))
    md, _ = report_files(root)
    return {
        "root": root, "labels": labels, "scores": scores, "md": md.read_text(),
        "html": (root / "viewer.html").read_text(), "trace": tiny_trace,
    }


def test_report_writes_and_lists_the_viewer(run):
    assert "viewer.html" in run["md"]
    html = run["html"]
    assert "<script src" not in html and "http://" not in html and "https://" not in html  # self-contained, no network
    data = page_data(html)
    assert [p["id"] for p in data["prompts"]] == run["trace"].prompt_ids
    assert data["meta"]["rules"] == list(RULES)


def test_data_follow_rank_evals_conventions(run):
    """Harm threshold (the figures' quantile:0.8 here, no rank-eval), unresolved flags, and each rule's eviction at
    several ρ rebuilt from the page's ranks equal kvdiag.rankeval.metrics.eviction_counts."""
    labels, scores, data = run["labels"], run["scores"], page_data(run["html"])
    kl = labels["kl_mean"].to_numpy()
    unres = kl <= labels["noise_floor"].to_numpy()
    threshold = harm_threshold(kl[~unres], "quantile:0.8")
    assert data["meta"]["threshold"] == pytest.approx(threshold) and data["meta"]["harm"] == "quantile:0.8"
    joined = labels.join(scores, on=list(KEYS))
    checked = 0
    for p in data["prompts"]:
        assert len(p["tokens"]) == run["trace"].length(p["id"])
        for c in p["ckpts"]:
            g = joined.filter((pl.col("prompt_id") == p["id"]) & (pl.col("checkpoint") == c["t"])).sort("position")
            assert c["pos"] == g["position"].to_list()
            gkl = g["kl_mean"].to_numpy()
            g_unres = gkl <= g["noise_floor"].to_numpy()
            y = (gkl > threshold) & ~g_unres
            assert c["st"] == np.where(y, 1, np.where(g_unres, 2, 0)).tolist()
            assert c["kl"] == pytest.approx(gkl, rel=1e-3)
            assert c["flips"] == g["top1_flips"].to_list() and c["age"] == g["age"].to_list()
            for k, rule in enumerate(RULES):
                lo = np.array(c["lo"][k])
                sz = np.array(c["sz"].get(str(k), [1] * len(lo)))
                for rho in (0.1, 0.5, 0.77):
                    n = int(n_evicted(rho, c["n"][k]))
                    share = np.clip((n - lo) / sz, 0, 1)  # what the page's script computes
                    ev, hev = eviction_counts(y.astype(float), g[rule].to_numpy(), rho)
                    assert share.sum() == pytest.approx(ev[0]) and (share * y).sum() == pytest.approx(hev[0])
                    checked += 1
    assert checked == 2 * 2 * len(RULES) * 3
    assert any(c["sz"] for p in data["prompts"] for c in p["ckpts"])  # the tie path is exercised


def test_figure_marks(run):
    p = page_data(run["html"])["prompts"][0]
    lab0 = run["labels"].row(0, named=True)
    assert p["dr"] == {"3": [20, 17, True]}  # delayed entries only
    assert p["bs"] == {str(lab0["checkpoint"]): [[lab0["position"], 0.01, 7.5]]}


def test_prompts_without_labels_are_left_out(run):
    trace, labels = run["trace"], run["labels"]
    first, second = trace.prompt_ids[:2]
    lens = {pid: trace.prompt_len(pid) for pid in trace.prompt_ids}
    data = viewer_data(trace.tokens, lens, labels.filter(pl.col("prompt_id") == first))
    assert [p["id"] for p in data["prompts"]] == [first] and second in data["meta"]["notes"][-1]
    assert data["meta"]["rules"] == [] and all(c["lo"] == [] for c in data["prompts"][0]["ckpts"])


def test_bad_input(run, tmp_path):
    trace, labels, scores = run["trace"], run["labels"], run["scores"]
    with pytest.raises(UserError, match="needs the labels"):
        build_viewer(trace, None, scores, tmp_path / "v.html")
    with pytest.raises(UserError, match="needs the Trace"):
        build_viewer(None, labels, scores, tmp_path / "v.html")
    with pytest.raises(UserError, match="another Trace"):
        build_viewer(trace, labels, scores, tmp_path / "v.html", labels_meta={"trace": {"fingerprint": "0" * 16}})
    with pytest.raises(UserError, match="no token-granularity"):
        build_viewer(
            trace, labels.with_columns(granularity=pl.lit("layer"), layer=pl.lit(0, pl.Int64)), None,
            tmp_path / "v.html",
        )
    with pytest.raises(UserError, match="--harm"):
        build_viewer(trace, labels, scores, tmp_path / "v.html", settings=ViewerSettings(harm="top:3"))
    # a run without labels still gets its report; the report says why there is no viewer
    root = tmp_path / "run"
    shutil.copytree(trace.path, root / "trace")
    md, _ = report_files(root)
    assert not (root / "viewer.html").exists() and "needs the labels" in md.read_text()


# --------------------------------------------------------------------------- the page in headless Chromium


def chromium() -> str | None:
    return os.environ.get("KVDIAG_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


needs_chromium = pytest.mark.skipif(chromium() is None, reason="chromium not installed (apt-get install chromium; "
                                                               "make browser)")


class Browser:
    """A headless Chromium page driven over the DevTools protocol on a pipe (no websocket, no driver)."""

    def __init__(self, url: str, width: int = 1280, height: int = 900):
        self.profile = tempfile.mkdtemp(prefix="kvdiag-chromium-")
        to_chrome, self._w = os.pipe()
        self._r, from_chrome = os.pipe()

        def fds():  # the browser reads commands on fd 3 and writes replies on fd 4 (dup first: either may be 3 or 4)
            a, b = os.dup(to_chrome), os.dup(from_chrome)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen(
            [
                chromium(), "--headless=new", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
                "--no-first-run", "--disable-extensions", "--disable-background-networking", "--disable-dev-shm-usage",
                f"--user-data-dir={self.profile}", f"--window-size={width},{height}", "about:blank",
            ],
            preexec_fn=fds,
            pass_fds=(3, 4),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_chrome)
        os.close(from_chrome)
        self._buf, self._id = b"", 0
        target = self.call("Target.createTarget", url=url)["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call(
            "Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False,
            session=True,
        )

    def call(self, method: str, session: bool = False, **params):
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        while True:
            while b"\0" not in self._buf:
                chunk = os.read(self._r, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"chromium closed the pipe during {method}")
                self._buf += chunk
            raw, self._buf = self._buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def js(self, expression: str):
        """The value of a JavaScript expression in the page (promises awaited)."""
        r = self.call("Runtime.evaluate", session=True, expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise AssertionError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait(self, expression: str, timeout: float = 30.0):
        end = time.monotonic() + timeout
        while not self.js(expression):
            if time.monotonic() > end:
                raise TimeoutError(expression)
            time.sleep(0.05)

    def hover(self, selector: str):
        box = self.js(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); e.scrollIntoView({{block: "
                      f"'center'}});"
                      " const r = e.getBoundingClientRect(); return [r.left + r.width / 2, r.top + r.height / 2]; })()")
        self.call("Input.dispatchMouseEvent", session=True, type="mouseMoved", x=box[0], y=box[1])

    def screenshot(self, path: Path):
        import base64

        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", session=True, format="png")["data"]))

    def close(self):
        try:
            self.call("Browser.close")
        except (RuntimeError, OSError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.close(self._w)
        os.close(self._r)
        shutil.rmtree(self.profile, ignore_errors=True)


def select(name: str, value) -> str:
    """JS: choose ``value`` in the select ``#name`` as a user would, and resolve with the ms until the next frame
    has been painted (the recolour as a user sees it)."""
    return (f"new Promise(done => {{ const s = document.getElementById({json.dumps(name)}), t0 = performance.now();"
            f" s.value = {json.dumps(str(value))}; s.dispatchEvent(new Event('change'));"
            " requestAnimationFrame(() => setTimeout(() => done(performance.now() - t0), 0)); })")


CLASSES = "Array.from(document.querySelectorAll('#tokens span'), s => s.className)"


@pytest.fixture
def browser():
    opened = []

    def open_page(path: Path) -> Browser:
        b = Browser(path.resolve().as_uri())
        opened.append(b)
        b.wait("document.body && document.body.dataset.ready === '1'")
        return b

    yield open_page
    for b in opened:
        b.close()


@needs_chromium
def test_page_in_chromium(run, browser, tmp_path):
    """Tokens shown, a checkpoint switch recolours them, a rule (the one with most misses) marks its evictions with the
    counts of
    eviction_counts, hover text present; a screenshot is written."""
    path = Path(os.environ.get("KVDIAG_VIEWER") or run["root"] / "viewer.html")
    data = page_data(path.read_text())
    b = browser(path)
    # the first prompt with two checkpoints, chosen as a user would
    pi = next((k for k, p in enumerate(data["prompts"]) if len(p["ckpts"]) > 1), 0)
    if pi:
        b.js(select("prompt", pi))
    p0 = data["prompts"][pi]
    assert b.js("document.getElementById('ckpt').options.length") == len(p0["ckpts"])
    assert b.js("document.querySelectorAll('#tokens span').length") == len(p0["tokens"])
    assert b.js("document.getElementById('tokens').textContent") == "".join(p0["tokens"]).replace("\n", "↵\n")
    before = b.js(CLASSES)
    assert sum(" k" in c or " un" in c for c in before) == len(p0["ckpts"][0]["pos"])  # labeled tokens coloured
    last = len(p0["ckpts"]) - 1
    b.js(select("ckpt", last))
    after = b.js(CLASSES)
    assert after != before
    c = p0["ckpts"][last]
    for j, i in enumerate(c["pos"]):
        assert (" un" in after[i]) == (c["st"][j] == 2)

    rules = data["meta"]["rules"]
    y = np.array(c["st"]) == 1

    def eviction(k: int) -> tuple[int, np.ndarray]:
        """Rule k's evicted count and per-candidate eviction share at the page's ρ (the script's arithmetic)."""
        lo = np.array(c["lo"][k])
        sz = np.array(c["sz"].get(str(k), [1] * len(lo)))
        n = int(n_evicted(data["meta"]["rho"], c["n"][k]))
        return n, np.where(lo < 0, 0, np.clip((n - lo) / np.maximum(sz, 1), 0, 1))

    k = int(np.argmax([(eviction(k)[1] * y).sum() for k in range(len(rules))]))  # the rule with the most misses
    b.js(select("rule", k))
    marked = b.js(CLASSES)
    n, share = eviction(k)
    assert int(b.js("+document.getElementById('n-evicted').textContent")) == n
    assert float(b.js("+document.getElementById('n-misses').textContent")) == pytest.approx((share * y).sum(), abs=0.01)
    for j, i in enumerate(c["pos"]):
        assert (" ev" in marked[i] or " ep" in marked[i]) == (share[j] > 0)
        assert (" ms" in marked[i]) == (share[j] > 0 and y[j])

    i = c["pos"][int(np.argmax(share * (1 + y)))]  # a miss if there is one
    b.hover(f"#tokens span[data-i='{i}']")
    b.wait("!document.getElementById('tip').hidden", 5)
    tip = b.js("document.getElementById('tip').textContent")
    assert (
        f"position {i}" in tip
        and "kl_mean" in tip
        and "top-1 flips" in tip
        and f"age {c['age'][c['pos'].index(i)]}" in tip
    )
    assert all(r in tip for r in rules) and "percentile" in tip

    shot = Path(os.environ.get("KVDIAG_SCREENSHOT") or tmp_path / "viewer.png")
    b.screenshot(shot)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # a budget: keep B of the C scored candidates
    b.js(select("mode", "budget"))
    b.js("(() => { const a = document.getElementById('amount'); a.value = '3'; a.dispatchEvent(new Event('input')); "
         "})()")
    assert int(b.js("+document.getElementById('n-evicted').textContent")) == max(c["n"][k] - 3, 0)
    if len(data["prompts"]) > 1:
        other = (pi + 1) % len(data["prompts"])
        b.js(select("prompt", other))
        assert b.js("document.querySelectorAll('#tokens span').length") == len(data["prompts"][other]["tokens"])
        assert b.js("document.getElementById('ckpt').options.length") == len(data["prompts"][other]["ckpts"])


def synthetic_long(
    n_tokens: int = 4096, n_rules: int = 20, every: int = 256, candidates: int = 1024, seed: int = 0
) -> dict:
    """Page data of one synthetic prompt: ``n_tokens`` tokens, a checkpoint every ``every`` tokens with up to
    ``candidates`` labeled entries, ``n_rules`` scored rules."""
    rng = np.random.default_rng(seed)
    words = ["the", " x", " =", " 2", "\n", " so", " we", " get", ".", " Let"]
    tokens = pl.DataFrame(
        {"prompt_id": "long", "position": np.arange(n_tokens), "token_id": rng.integers(0, 10, n_tokens)}
    )
    tokens = tokens.with_columns(token_text=pl.col("token_id").map_elements(lambda i: words[i], return_dtype=pl.String))
    rows = []
    for t in range(every, n_tokens + 1, every):
        pos = np.sort(rng.choice(t, min(t, candidates), replace=False))
        rows.append(
            pl.DataFrame(
                {
                    "prompt_id": "long", "checkpoint": t, "position": pos, "granularity": "token", "layer": -1,
                    "kv_head": -1, "kl_mean": np.exp(rng.normal(-6, 2, len(pos))), "noise_floor": 1e-4,
                    "top1_flips": rng.integers(0, 3, len(pos)), "age": t - pos,
                }
            )
        )
    labels = pl.concat(rows)
    scores = labels.select(KEYS).with_columns(
        **{f"rule_{k:02d}": pl.Series(rng.normal(size=labels.height)) for k in range(n_rules)}
    )
    return viewer_data(tokens, {"long": 64}, labels, scores)


@needs_chromium
def test_responsive_on_4k_tokens_and_20_rules(browser, tmp_path):
    """4,096 tokens, 16 checkpoints of up to 1,024 candidates, 20 rules: switching checkpoint and rule (recolour up to
    the next painted frame) takes tens of ms; the bound leaves room for a loaded CI machine. Times printed (pytest
    -s)."""
    t0 = time.perf_counter()
    path = tmp_path / "viewer.html"
    path.write_text(viewer_html(synthetic_long()))
    build_s = time.perf_counter() - t0
    b = browser(path)
    load_ms = b.js("performance.now()")
    times = {"checkpoint": [], "rule": []}
    for step in range(8):
        times["checkpoint"].append(b.js(select("ckpt", (step * 5) % 16)))
        times["rule"].append(b.js(select("rule", (step * 7) % 20)))
    b.hover("#tokens span[data-i='4000']")
    b.wait("!document.getElementById('tip').hidden", 5)
    med = {k: float(np.median(v)) for k, v in times.items()}
    print(f"\n4k tokens x 20 rules: page {path.stat().st_size / 1e6:.2f} MB, built in {build_s:.2f} s, loaded in "
          f"{load_ms:.0f} ms; "
          f"median switch checkpoint {med['checkpoint']:.1f} ms (max {max(times['checkpoint']):.1f}), "
          f"rule {med['rule']:.1f} ms (max {max(times['rule']):.1f})")
    assert med["checkpoint"] < 250 and med["rule"] < 250
