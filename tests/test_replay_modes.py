"""The replay modes (``FreeRunning``, ``TeacherForced``) and the selection object: the parts' resume keys are
byte-identical to those of the code before the modes (commit 559cdef), so finished ``parts/`` directories and
committed reports still resume; a run's outputs are those of that code; selection strings are parsed once."""

from __future__ import annotations

import hashlib
import json
from types import SimpleNamespace

import polars as pl
import pytest
import torch

from kvdiag.core.errors import UserError
from kvdiag.core.selection import Selection, select_keep
from kvdiag.decisions import Budget, DecisionsConfig
from kvdiag.replay import FreeRunning, Policy, ReplaySettings, TeacherForced, make_scorer, replay, teacher_force
from kvdiag.replay.decoding import batches, decode
from kvdiag.replay.oracle import ORACLE, LiveLabels, OracleRule
from kvdiag.replay.units import Item

# --------------------------------------------------------------------------- resume keys

MODEL = {"config_hash": "c0ffee0123456789", "weights_hash": "beefbeef01234567", "dtype": "float32"}
ITEMS = [Item("p0", [1, 5, 9, 2, 7, 3], 4, "12"), Item("p/1", [4, 4, 8, 6, 1], 3, None, "exact")]
TRACE = SimpleNamespace(fingerprint="0123456789abcdef", provenance={"path": "t", "fingerprint": "0123456789abcdef"})
# settings, teacher-forced?, and the part -> fingerprint map that 559cdef's replay() computed for them (its
# PartStore.done calls, recorded with the model, items and Trace above and the policies of ``_policies``)
CASES = {
    "free_greedy": (dict(scorers=["rkv", "knorm"], budgets=[16, 32], interval=8), False, {
        "p0__full_kv__full.parquet": "a3b5f7ff011ef3a1", "p0__rkv__16.parquet": "0b68a862924c89dd",
        "p0__rkv__32.parquet": "fbfee58070de8f17", "p0__knorm__16.parquet": "197d6145568547df",
        "p0__knorm__32.parquet": "cdd940c0504996ed", "p_1__full_kv__full.parquet": "e9edcb12a750386c",
        "p_1__rkv__16.parquet": "e3ddca631e3ae964", "p_1__rkv__32.parquet": "d7d2f463a97a2757",
        "p_1__knorm__16.parquet": "18660c1979bb694e", "p_1__knorm__32.parquet": "59ab701a4d116794"}),
    "free_sampled": (dict(scorers=["rkv"], budgets=[16], samples=2, temperature=0.6, top_p=0.9, seed=3,
                          selection="stochastic:0.2", params={"rkv": {"mix_lambda": 0.07}}, w_obs=8), False, {
        "p0__full_kv__full__s0.parquet": "9251a5d2fa644f21", "p0__full_kv__full__s1.parquet": "23122a9319ca6a2a",
        "p0__rkv__16__s0.parquet": "5e5f700060f7cbd5", "p0__rkv__16__s1.parquet": "3b52ac94b904a408",
        "p_1__full_kv__full__s0.parquet": "dfb2bb03e715cc62", "p_1__full_kv__full__s1.parquet": "d06c29c91ae94843",
        "p_1__rkv__16__s0.parquet": "5d06a9c2ccc328dc", "p_1__rkv__16__s1.parquet": "7b7f6f88261d5b3e"}),
    "free_stochastic": (dict(scorers=["knorm"], budgets=[24], selection="stochastic", seed=5, kl=False,
                             full_kv=False, max_new_tokens=40, chat=False, instruction=None), False, {
        "p0__knorm__24.parquet": "bdbc784478b40eab", "p_1__knorm__24.parquet": "d89a40b175d4c1ff"}),
    "tf_oracle": (dict(scorers=[ORACLE, "rkv"], budgets=[16], selection="per-token", horizon=4), True, {
        "p0__oracle__16.parquet": "9194aca1ff10e430", "p0__rkv__16.parquet": "551a1dbd8f19669d",
        "p_1__oracle__16.parquet": "6af37bef483c2143", "p_1__rkv__16.parquet": "f8135d9dcab0d753"}),
    "tf_nojoint": (dict(scorers=["rkv"], budgets=[16, 20], joint=False, seed=7), True, {
        "p0__rkv__16.parquet": "661cf75dcd5d3cde", "p0__rkv__20.parquet": "45ad6b46fec32318",
        "p_1__rkv__16.parquet": "eb204b3e1f3108a2", "p_1__rkv__20.parquet": "a627cf233549eb15"}),
}


def _policies(settings: ReplaySettings, teacher_forced: bool) -> dict:
    pols = {} if teacher_forced or not settings.full_kv else {("full_kv", None): None}
    for name in settings.scorers:
        scorer = (OracleRule(settings.horizon) if name == ORACLE
                  else make_scorer(name, settings.params.get(name), settings.w_obs))
        for b in settings.budgets:
            pols[(name, b)] = Policy(scorer, b, settings.interval, settings.selection)
    return pols


@pytest.mark.parametrize("case", list(CASES))
def test_part_names_and_fingerprints_are_those_before_the_modes(case):
    kw, teacher_forced, want = CASES[case]
    mode = TeacherForced(TRACE) if teacher_forced else FreeRunning([])
    settings = mode.adjust(ReplaySettings(**kw))
    units = mode.units(MODEL, settings, ITEMS, _policies(settings, teacher_forced))
    assert [(u.part, u.fingerprint) for u in units] == list(want.items())  # names, keys and their order


# --------------------------------------------------------------------------- outputs


def digest(df: pl.DataFrame) -> tuple[str, list, list]:
    """A run's outputs: a hash of every row's integers and strings (tokens, compactions, cache sizes, stop), its
    mean KL and the sum of its joint labels (floats, compared with a tolerance)."""
    rows = df.sort("prompt_id", "scorer", "budget", "sample", nulls_last=True)
    exact = rows.select("prompt_id", "scorer", "budget", "sample", "mode", "token_ids", "compression_steps",
                        "peak_kv", "stop", "text", "max_length_hit", "correct").to_dicts()
    sha = hashlib.sha256(json.dumps(exact).encode()).hexdigest()[:16]
    return sha, rows["kl_mean"].to_list(), [None if j is None else sum(j) for j in rows["joint_kl"].to_list()]


def run_cases(lm, trace, root) -> dict[str, tuple]:
    """The outputs of a greedy, a sampled stochastic and a teacher-forced oracle sweep on ``lm``."""
    from kvdiag.tasks.prompts import load_prompts

    prompts = load_prompts("builtin:arith", limit=2)
    base = dict(interval=8, max_new_tokens=24, chat=False, instruction=None)
    runs = {
        "greedy": (ReplaySettings(scorers=["rkv", "knorm"], budgets=[16, 24], **base), {"prompts": prompts}),
        "sampled": (ReplaySettings(scorers=["rkv"], budgets=[16], samples=2, temperature=0.8, top_p=0.9,
                                   selection="stochastic:0.3", seed=4, **base), {"prompts": prompts}),
        "oracle": (ReplaySettings(scorers=[ORACLE, "rkv"], budgets=[16], interval=8, selection="per-token",
                                  horizon=4), {"trace": trace}),
    }
    return {name: digest(pl.read_parquet(replay(lm, root / name, settings, **source, command="test",
                                                show_progress=False) / "generations.parquet"))
            for name, (settings, source) in runs.items()}


# run_cases(tiny_llama, tiny_trace, ...) under 559cdef (the code before the modes), same machine and shapes
BEFORE = {
    "greedy": ("66f1ed2cab2e2a3f",
             [None, 2.337549489099859, 2.27178086605543, 2.2701366184584946, 2.0831732453856087, None,
              2.171273129260069, 2.3401975424213632, 2.1114963516157523, 1.820077313464556],
             [None, None, None, None, None, None, None, None, None, None]),
    "sampled": ("06bdce0da9a6a95f",
             [None, None, 2.0123940876747244, 2.248374280137423, None, None, 2.2311509889868364, 2.188031722404107],
             [None, None, None, None, None, None, None, None]),
    # the rkv rows (1, 3) changed with the positioned cache (#44): before it, the label engine's full-cache forwards
    # (queries of t .. t+H, the future) ran through replay's recording attention and entered rkv's query window
    "oracle": ("34cd81b667a26579",
             [1.7108286626874467, 2.084392658639699, 1.9016303941438584, 2.1968032379915083],
             [30.863732762634754, 45.555575758218765, 37.38414341956377, 49.20409631729126]),
}


def test_outputs_are_those_before_the_modes(tiny_llama, tiny_trace, tmp_path):
    """Tokens, compactions, stops and verdicts exactly; KL and joint labels within rtol 1e-5, atol 1e-7 (the same
    shapes through the same kernels; the tolerance allows another thread count's summation order)."""
    got = run_cases(tiny_llama, tiny_trace, tmp_path)
    assert got.keys() == BEFORE.keys()
    for name, (sha, kl, joint) in BEFORE.items():
        assert got[name][0] == sha, name
        for want, have in ((kl, got[name][1]), (joint, got[name][2])):
            assert [w is None for w in want] == [h is None for h in have], name
            assert [h for h in have if h is not None] == pytest.approx([w for w in want if w is not None],
                                                                       rel=1e-5, abs=1e-7), name


def test_the_oracle_labels_no_joint_damage_with_no_joint(tiny_llama):
    """``--no-joint``: the oracle still runs on its per-entry labels, but no compression's joint set is labeled, and
    the policy keeps the same entries either way (bitwise: the same shapes through the same path)."""
    ids = decode(tiny_llama, list(range(40, 70)), None, max_new_tokens=40).token_ids
    pol = Policy(OracleRule(8), 20, 16, "per-token")
    runs = {}
    for joint in (True, False):
        live = LiveLabels(tiny_llama, torch.tensor(ids), 8)
        runs[joint] = (teacher_force(tiny_llama, ids, 30, pol, keep_history=True, labels=live, joint=joint), live)
    (on, on_labels), (off, off_labels) = runs[True], runs[False]
    assert len(on.compressions) >= 2 and on_labels.rows["joint"] == len(on.joint) == len(on.compressions)
    assert off_labels.rows["joint"] == 0 and off.joint == [] and off_labels.rows["oracle"] == on_labels.rows["oracle"]
    assert off.compressions == on.compressions
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(on.kept, off.kept, strict=True))
    assert torch.equal(on.logprobs, off.logprobs)


# --------------------------------------------------------------------------- selection and batches


def test_a_selection_is_parsed_once_and_keeps_its_spec():
    assert Selection.parse("per-head") == Selection("per-head", None, "per-head")
    sto = Selection.parse("stochastic")
    assert (sto.mode, sto.tau, str(sto), sto.stochastic, sto.per_token) == ("stochastic", 0.1, "stochastic", True,
                                                                            False)
    assert str(Selection.parse("stochastic:0.10")) == "stochastic:0.10"  # the spec as given names the setting
    assert Selection.parse(sto) is sto and sto.deterministic.mode == "per-head"
    assert Selection.parse("per-token").deterministic.per_token
    for bad in ("greedy", "per-head:2", "stochastic:0", "stochastic:x", "stochastic:inf"):
        with pytest.raises(UserError, match="--selection"):
            Selection.parse(bad)
    # the objects that hold a selection parse a spec string once, and write the spec back
    settings = ReplaySettings(scorers=["rkv"], budgets=[16], selection="stochastic:0.2")
    assert settings.selection == Selection("stochastic", 0.2, "stochastic:0.2")
    assert settings.to_json()["selection"] == "stochastic:0.2"
    assert Policy(make_scorer("rkv"), 16, 8, "per-token").selection.per_token
    cfg = DecisionsConfig(budgets=(Budget("keep", 0.5),), selection="per-token")
    assert cfg.selection.per_token and cfg.settings()["selection"] == "per-token"


def test_stochastic_selection_refuses_a_fixed_order():
    streaming = make_scorer("streamingllm")
    with pytest.raises(UserError, match="streamingllm"):
        Selection.parse("stochastic").check_rule(streaming)
    Selection.parse("per-head").check_rule(streaming)  # deterministic selections take any rule


def test_select_keep_takes_the_object_or_its_spec():
    gen = torch.Generator().manual_seed(0)
    scores = [torch.randn(2, 12, generator=gen) for _ in range(3)]
    for spec in ("per-head", "per-token"):
        assert torch.equal(select_keep(scores, 5, spec), select_keep(scores, 5, Selection.parse(spec)))


def test_batches_group_by_key_in_first_seen_order():
    rows = [("a", 1), ("b", 2), ("a", 3), ("a", 4), ("b", 5), ("c", 6), ("a", 7)]
    assert batches(rows, 2, lambda r: r[0]) == [[("a", 1), ("a", 3)], [("a", 4), ("a", 7)], [("b", 2), ("b", 5)],
                                                [("c", 6)]]
    assert batches([], 4, lambda r: r) == []


def test_bench_replay_batches_rows_of_several_lengths_and_budgets(tiny_llama):
    """``bench replay`` batches as the sweep does (one grouping): rows of another prompt length or budget go to
    their own batches, and each batched row is compared with the same row decoded alone."""
    from kvdiag.replay.bench import run_replay_bench

    prompts = [list(range(40, 60)), list(range(70, 95)), list(range(100, 120))]  # 20, 25 and 20 tokens
    pols = [Policy(make_scorer("rkv"), 16, 6), Policy(make_scorer("knorm"), 20, 6)]
    # batches: (p0, p2) under rkv, then under knorm, then p1 under each: not the rows' order
    r = run_replay_bench(tiny_llama, prompts, ["p0", "p1", "p2"], pols, 14, batch_size=3)
    assert r.rows == 6 and r.same_tokens["alone"] == 6


def test_joint_labels_do_not_reach_the_query_window(tiny_llama):
    """The label engine's forwards (future queries) never enter the compressor's query window: a rule that reads it
    keeps the same entries and gets the same log-probs with and without joint labels (bitwise: same shapes, same
    path)."""
    ids = list(range(40, 100))
    pol = Policy(make_scorer("rkv"), 16, 8, "per-token")
    labels = LiveLabels(tiny_llama, torch.tensor(ids), 4)
    plain = teacher_force(tiny_llama, ids, 20, pol, "p", keep_history=True)
    joint = teacher_force(tiny_llama, ids, 20, pol, "p", keep_history=True, labels=labels)
    assert len(joint.joint) == len(joint.compressions) > 2
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(plain.kept, joint.kept, strict=True))
    assert torch.equal(plain.logprobs, joint.logprobs)
