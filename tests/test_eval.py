"""`anychip eval`: scoring against hand-computed numbers, both item shapes, lm-eval tokenization, windows, and
(slow) a real run through vLLM."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest

from anychip.eval import runner
from anychip.eval.requests import PairEncoder, pair_sequence, plan_requests, rolling_windows
from anychip.eval.scoring import Z95, item_correct, paired_delta, perplexity, score_task, stderr
from anychip.eval.tasks import EvalDataError, load_task, parse_item, resolve_data_dir, select_tasks


def test_acc_and_acc_norm_differ_on_a_toy_item():
    # " a" is 2 bytes, " bbbbbbbb" 9: raw loglik prefers the short one, per-byte loglik the long one.
    logliks, lengths = [-2.0, -4.0], [2, 9]
    assert item_correct(logliks, lengths, label=1) == (0.0, 1.0)  # -2 > -4, but -1.0 < -0.444
    assert item_correct(logliks, lengths, label=0) == (1.0, 0.0)


def test_task_score_hand_computed():
    logliks = [[-2.0, -4.0], [-1.0, -3.0, -0.5], [-6.0, -6.0]]
    lengths = [[2, 9], [4, 4, 1], [3, 6]]
    labels = [1, 2, 0]
    # item 1: acc argmax 0 (wrong), norm [-1, -.444] -> 1 (right)
    # item 2: acc argmax 2 (right), norm [-.25, -.75, -.5] -> 0 (wrong)
    # item 3: tie -> first (right), norm [-2, -1] -> 1 (wrong)
    s = score_task(logliks, lengths, labels).summary()
    assert s["n"] == 3
    assert s["acc"] == pytest.approx(2 / 3) and s["acc_norm"] == pytest.approx(1 / 3)
    assert s["acc_stderr"] == pytest.approx(math.sqrt((2 / 3) * (1 / 3) * 3 / 2 / 3))


def test_paired_delta_hand_computed():
    a, b = [1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0]
    d, lo, hi = paired_delta(a, b)
    se = math.sqrt(1 / 3) / 2  # differences [1, 0, 0, 1]: sd (ddof=1) sqrt(1/3), n = 4
    assert d == pytest.approx(0.5)
    assert (lo, hi) == pytest.approx((0.5 - Z95 * se, 1.0))  # 0.5 + Z95 * se = 1.07: a difference is at most 1
    assert math.isnan(stderr([1.0]))


def test_perplexity():
    assert perplexity(-2.0 * 10, 10) == pytest.approx(math.exp(2.0))


def test_both_item_shapes(tmp_path):
    path = tmp_path / "mixed.jsonl"
    rows = [{"id": "s", "context": "Q: sky?\nA:", "choices": [" blue", " green"], "label": 0},
            {"id": "p", "contexts": ["The cat sat", "The dog sat"], "continuation": " on the mat", "label": 1}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    task = load_task(path)
    assert task.name == "mixed" and len(task.items) == 2
    std, part = task.items
    assert std.requests() == [("Q: sky?\nA:", " blue"), ("Q: sky?\nA:", " green")]
    assert std.lengths == (5, 6)
    assert part.requests() == [("The cat sat", " on the mat"), ("The dog sat", " on the mat")]
    assert part.label == 1
    assert len(load_task(path, limit=1).items) == 1


def test_bad_items_name_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "x", "context": "c", "choices": [" a"], "label": 0}\n{"id": "y", "label": 0}\n')
    with pytest.raises(EvalDataError, match=re.escape(f"{path}:2")):
        load_task(path)
    with pytest.raises(EvalDataError, match="out of range"):
        parse_item({"context": "c", "choices": [" a"], "label": 3}, "here")


def test_task_files_as_editors_write_them(tmp_path):
    """A byte-order mark and old-Mac CR line ends are read; U+2028 inside a string does not split its line; a bad
    byte names its own line; a bad line after --limit's items is still named (before any engine starts)."""
    item = '{"context": "c\u2028d", "choices": [" a", " b"], "label": 0}'
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (item + "\r" + item + "\r\n").encode())
    task = load_task(path)
    assert len(task.items) == 2 and task.items[0].requests()[0][0] == "c\u2028d"
    path.write_bytes((item + "\n" + item + "\n").encode() + b'{"context": "caf\xe9"}\n')
    with pytest.raises(EvalDataError, match=re.escape(f"{path}:3: not UTF-8 text")):
        load_task(path)
    path.write_text(item + "\n" + '{"id": "y", "label": 0}\n')
    with pytest.raises(EvalDataError, match=re.escape(f"{path}:2")):
        load_task(path, limit=1)
    path.write_text(item + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")  # probe 49: a RecursionError traceback
    with pytest.raises(EvalDataError, match=re.escape(f"{path}:2: JSON nested too deep")):
        load_task(path)


def test_data_a_user_gets_wrong_is_named_before_any_engine_starts(tmp_path, monkeypatch, capsys):
    from anychip.cli import main

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was started for data that cannot be scored")

    monkeypatch.setattr(runner, "evaluate_all", no_engine)
    model = tmp_path / "model"  # never opened: every check below comes first
    cases = {
        "empty_choice": ('{"context": "c", "choices": [" a", ""], "label": 0}\n'.encode(), "choice 1 is an empty"),
        "empty_cont": ('{"contexts": ["a", "b"], "continuation": "", "label": 0}\n'.encode(), "'continuation' is"),
        "latin1": (b'{"context": "caf\xe9", "choices": [" a"], "label": 0}\n', "not UTF-8 text"),
    }
    for name, (raw, says) in cases.items():
        data = tmp_path / name
        data.mkdir()
        (data / "t.jsonl").write_bytes(raw)
        assert main(["eval", str(model), "--data", str(data)]) == 2
        err = capsys.readouterr().err
        assert says in err and f"{data / 't.jsonl'}" in err, err
    (tmp_path / "none").mkdir()
    assert main(["eval", str(model), "--data", str(tmp_path / "none")]) == 2
    assert "no *.jsonl task files" in capsys.readouterr().err
    (tmp_path / "bad.txt").write_bytes(b"abc \xff\xfe")
    assert main(["eval", str(model), "--tasks", "perplexity", "--text", str(tmp_path / "bad.txt")]) == 2
    assert "not UTF-8 text" in capsys.readouterr().err
    assert main(["eval", str(model), "--tasks", "perplexity", "--json", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_a_choice_longer_than_the_window_names_its_task_file(tmp_path, monkeypatch):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"context": "q", "choices": [" a", " " + "z" * 80], "label": 0}) + "\n")
    monkeypatch.setattr(runner, "make_engine", lambda model_dir, settings: FakeEngine())
    with pytest.raises(EvalDataError, match=re.escape(f"{path}: a choice of 81 tokens does not fit")):
        runner.evaluate_model(tmp_path, [path], None, runner.EvalSettings(window=8, stride=4, max_len=64))


def test_a_choice_longer_than_the_window_is_named_before_any_engine_starts(tmp_path, monkeypatch):
    """run_eval tokenizes the choices that could be too long (by their bytes) with the model's tokenizer before
    starting an engine: a long choice of few tokens passes, one of too many tokens names its file and item."""
    from conftest import _tiny_tokenizer, write_tiny_llama

    _tiny_tokenizer(tmp_path / "tok", 100)
    words = " " + " ".join(f"w{i % 9}" for i in range(70))  # 70 tokens of the word-level tokenizer
    short = {"id": "few", "context": "w2", "choices": [" w3", " " + "z" * 200], "label": 0}  # 200 bytes, 1 token
    long = {"id": "many", "context": "w2", "choices": [" w3", words], "label": 0}
    (tmp_path / "ok.jsonl").write_text(json.dumps(short) + "\n")
    (tmp_path / "long.jsonl").write_text(json.dumps(short) + "\n" + json.dumps(long) + "\n")
    tasks = [load_task(tmp_path / "ok.jsonl"), load_task(tmp_path / "long.jsonl")]
    runner.check_choices_fit(tasks[:1], 64, tmp_path / "tok")
    runner.check_choices_fit(tasks, 71, tmp_path / "tok")
    with pytest.raises(EvalDataError, match=re.escape(f"{tmp_path / 'long.jsonl'}: item many: a choice of 70 tokens "
                                                      "does not fit the model's 64-token window")):
        runner.check_choices_fit(tasks, 64, tmp_path / "tok")
    runner.check_choices_fit(tasks, 64, tmp_path / "no-tokenizer-here")  # left to the engine

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was started for a choice that cannot be scored")

    monkeypatch.setattr(runner, "evaluate_all", no_engine)
    model = write_tiny_llama(tmp_path / "model", max_position_embeddings=65)
    data = tmp_path / "data"
    data.mkdir()
    (data / "long.jsonl").write_text((tmp_path / "long.jsonl").read_text())
    with pytest.raises(EvalDataError, match="item many: a choice of 70 tokens does not fit the model's 64-token"):
        runner.run_eval(model, None, str(data), runner.EvalSettings(), False, None, verify="none")


def test_data_dir_resolution(tmp_path, monkeypatch):
    (tmp_path / "t1.jsonl").write_text('{"context": "c", "choices": [" a", " b"], "label": 0}\n')
    monkeypatch.setenv("ANYCHIP_EVALDATA", str(tmp_path))
    assert resolve_data_dir() == tmp_path
    assert resolve_data_dir(tmp_path) == tmp_path
    monkeypatch.setenv("ANYCHIP_EVALDATA", str(tmp_path / "nope"))
    with pytest.raises(EvalDataError, match="--data"):
        resolve_data_dir()
    files, ppl = select_tasks(["t1", "perplexity"], tmp_path)
    assert files == [tmp_path / "t1.jsonl"] and ppl
    with pytest.raises(EvalDataError, match="available: t1, perplexity"):
        select_tasks(["hellaswag"], tmp_path)


def bpe_like(text: str) -> list[str]:
    """A space glues onto the character after it, as in GPT-2 style BPE."""
    return re.findall(r" ?[^ ]| ", text)


def test_pair_encoding_moves_trailing_space_like_lm_eval():
    vocab: dict[str, int] = {}

    def encode(s: str) -> list[int]:
        return [vocab.setdefault(t, len(vocab)) for t in bpe_like(s)]

    enc = PairEncoder(encode, prefix_id=999)
    ctx, cont = enc("a b ", "c")  # lm-eval scores " c" after "a b", not "c" after "a b "
    assert [k for t in ctx for k, v in vocab.items() if v == t] == ["a", " b"]
    assert [k for t in cont for k, v in vocab.items() if v == t] == [" c"]
    assert enc("", " x")[0] == (999,)
    seq, n = pair_sequence(((1, 2, 3, 4), (5, 6)), max_len=4)
    assert seq == [3, 4, 5, 6] and n == 2


def test_requests_are_deduplicated(tmp_path):
    path = tmp_path / "dup.jsonl"
    row = {"context": "x y", "choices": [" a", " b"], "label": 0}
    path.write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")
    plan = plan_requests(load_task(path).items, PairEncoder(lambda s: [ord(c) for c in s], 0))
    assert len(plan.pairs) == 2 and plan.index == ((0, 1), (0, 1))
    assert plan.gather([-1.0, -2.0]) == [[-1.0, -2.0], [-1.0, -2.0]]


def test_rolling_windows_score_every_token_once():
    windows = rolling_windows(10, window=4, stride=2)
    scored = [t for w in windows for t in range(w.end - w.n_scored, w.end)]
    assert scored == list(range(1, 10))
    assert all(w.end - w.start <= 4 for w in windows)
    assert all(w.end - w.n_scored - w.start >= 2 for w in windows[1:])  # >= window - stride tokens of context


class FakeEngine:
    """logprob(token t | anything) = -t / 10 (letters_reversed: -(27 - t) / 10): loglikelihoods are easy to
    compute by hand."""

    name, max_len, prefix_id = "fake", 64, 0

    def __init__(self, letters_reversed: bool = False) -> None:
        self.reversed = letters_reversed

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 96 if c.isalpha() else 1 for c in text]

    def token_logprobs(self, seqs, desc):
        if self.reversed:
            return [[-(27 - t) / 10 for t in s[1:]] for s in seqs]
        return [[-t / 10 for t in s[1:]] for s in seqs]

    def close(self):
        pass


def test_evaluate_model_pipeline_with_a_fake_engine(tmp_path, monkeypatch):
    # choices " a" (tokens [1, 1]: -0.2, 2 bytes) and " zz" ([1, 26, 26]: -5.3, 3 bytes)
    path = tmp_path / "toy.jsonl"
    path.write_text(json.dumps({"context": "q", "choices": [" a", " zz"], "label": 1}) + "\n")
    monkeypatch.setattr(runner, "make_engine", lambda model_dir, settings: FakeEngine())
    result = runner.evaluate_model(tmp_path, [path], "abcd" * 8, runner.EvalSettings(window=8, stride=4, max_len=64))
    s = result.tasks["toy"].summary()
    assert (s["acc"], s["acc_norm"], s["n"]) == (0.0, 0.0, 1)
    # every token but the first is scored once: tokens b, c, d, a, ... (31 of them)
    expected_nll = sum(t / 10 for t in ([1, 2, 3, 4] * 8)[1:])
    assert result.ppl["tokens"] == 31
    assert result.ppl["ppl"] == pytest.approx(math.exp(expected_nll / 31))
    # a second model that ranks " zz" first (right answer) and scores the text differently: hand-computed deltas
    monkeypatch.setattr(runner, "make_engine", lambda model_dir, settings: FakeEngine(letters_reversed=True))
    other = runner.evaluate_model(tmp_path, [path], "abcd" * 8, runner.EvalSettings(window=8, stride=4, max_len=64))
    assert other.tasks["toy"].summary()["acc_norm"] == 1.0
    report = runner.build_report({"w4a8": result, "bf16": other}, runner.EvalSettings(), {})
    assert report["tasks"]["toy"]["delta"]["acc_norm"] == -1.0 and report["tasks"]["toy"]["delta"]["acc"] == -1.0
    other_nll = sum((27 - t) / 10 for t in ([1, 2, 3, 4] * 8)[1:])
    assert report["tasks"]["perplexity"]["delta"]["ppl_ratio"] == pytest.approx(
        math.exp((expected_nll - other_nll) / 31))
    assert "toy" in runner.format_report(report)


def _crash_or_score(model, task_files, text, settings):
    """evaluate_all's per-model function in the tests: "segv" dies by SIGSEGV (an engine crashing), "raise"
    raises, anything else returns an empty result."""
    import os
    import signal

    label = model.label
    if label == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if label == "raise":
        raise runner.EvalDataError("a bad task file")
    return runner.ModelResult(model=label)


def test_a_model_whose_process_dies_costs_only_itself(tmp_path):
    settings = runner.EvalSettings(jobs=2)
    targets = [runner.Target("w4a8", tmp_path), runner.Target("segv", tmp_path / "m.gguf", engine="llama.cpp"),
               runner.Target("bf16", tmp_path)]
    got = runner.evaluate_all(targets, [], None, settings, evaluate=_crash_or_score)
    assert [r.model for r in (got[0], got[2])] == ["w4a8", "bf16"]
    assert isinstance(got[1], runner.ModelProcessDied)
    assert "segv" in str(got[1]) and "SIGSEGV" in str(got[1]) and "AMX" in str(got[1])  # the llama.cpp fix named
    with pytest.raises(runner.EvalDataError, match="a bad task file"):  # an error inside a child is raised here
        runner.evaluate_all([runner.Target("raise", tmp_path)], [], None, settings, evaluate=_crash_or_score)


def test_report_names_the_models_that_died(tmp_path, monkeypatch, capsys):
    path = tmp_path / "toy.jsonl"
    path.write_text(json.dumps({"context": "q", "choices": [" a", " zz"], "label": 1}) + "\n")
    monkeypatch.setattr(runner, "make_engine", lambda model_dir, settings: FakeEngine())
    ok = runner.evaluate_model(tmp_path, [path], None, runner.EvalSettings())
    died = runner.ModelProcessDied("llama.cpp-Q4_0: its evaluation process was killed by SIGSEGV")
    monkeypatch.setattr(runner, "targets_to_evaluate", lambda *a, **k: [
        runner.Target("w4a8", tmp_path), runner.Target("llama.cpp-Q4_0", tmp_path, engine="llama.cpp",
                                                       baseline="bf16")])
    monkeypatch.setattr(runner, "evaluate_all", lambda targets, *a, **k: [ok, died])
    report = runner.run_eval(tmp_path, None, str(tmp_path), runner.EvalSettings(), False, None, verify="none")
    assert list(report["models"]) == ["w4a8"] and report["failed"] == {"llama.cpp-Q4_0": str(died)}
    assert "not evaluated: llama.cpp-Q4_0" in runner.format_report(report)
    # the model under evaluation itself dying is an error, not a report
    monkeypatch.setattr(runner, "evaluate_all", lambda targets, *a, **k: [died, ok])
    with pytest.raises(runner.ModelProcessDied):
        runner.run_eval(tmp_path, None, str(tmp_path), runner.EvalSettings(), False, None, verify="none")


def test_compare_bf16_reads_the_recorded_source(tmp_path):
    src = tmp_path / "bf16"
    src.mkdir()
    (src / "config.json").write_text("{}")
    q = tmp_path / "w4a8"
    q.mkdir()
    (q / "config.json").write_text(json.dumps({"quantization_config": {"anychip": {"source": str(src)}}}))
    assert runner.bf16_source(q) == src
    from anychip.errors import AnychipError

    with pytest.raises(AnychipError, match="not quantized"):
        runner.bf16_source(src)


def test_compare_bf16_refuses_a_source_that_is_another_model_now(tiny_llama, tmp_path):
    """The recorded source path now holds another shape, or other weights of the same shape: the comparison
    would be against a model the checkpoint was not made from."""
    import shutil

    from anychip.checkpoint.quantize import quantize_checkpoint
    from anychip.checkpoint.scheme import W4A8Scheme
    from anychip.errors import AnychipError

    src = shutil.copytree(tiny_llama(), tmp_path / "bf16")
    w4a8 = quantize_checkpoint(src, tmp_path / "w4a8", W4A8Scheme(32))
    assert runner.bf16_source(w4a8) == src
    shard = next(src.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes())  # the same bytes, rewritten: the record no longer matches
    with pytest.raises(AnychipError, match="has changed since this checkpoint was made"):
        runner.bf16_source(w4a8)
    shutil.rmtree(src)
    shutil.copytree(tiny_llama(hidden_size=128, intermediate_size=256), src)
    with pytest.raises(AnychipError, match=r"is another model now: hidden_size 128 \(this checkpoint: 64\)"):
        runner.bf16_source(w4a8)


def test_bf16_names_a_moved_source(tiny_llama, tmp_path, capsys):
    """--bf16 DIR: the source moved or copied without its files' times is accepted where its shape and its files'
    names and sizes match the record; another shape or other files are refused, before any engine starts."""
    import shutil

    from anychip.checkpoint.quantize import quantize_checkpoint
    from anychip.checkpoint.scheme import W4A8Scheme
    from anychip.cli import main
    from anychip.errors import AnychipError

    src = shutil.copytree(tiny_llama(), tmp_path / "bf16")
    w4a8 = quantize_checkpoint(src, tmp_path / "w4a8", W4A8Scheme(32))
    moved = shutil.copytree(src, tmp_path / "elsewhere", copy_function=shutil.copy)  # new file times
    shutil.rmtree(src)
    with pytest.raises(AnychipError, match="is gone.*--bf16"):
        runner.bf16_source(w4a8)
    assert runner.bf16_source(w4a8, moved) == moved
    assert runner.models_to_evaluate(w4a8, moved) == {"w4a8": w4a8, "bf16": moved}
    with pytest.raises(AnychipError, match="--bf16 .*no model directory"):
        runner.bf16_source(w4a8, tmp_path / "nothing")
    other = tiny_llama(hidden_size=128, intermediate_size=256)
    with pytest.raises(AnychipError, match=r"^--bf16 .*another model than .*: hidden_size 128") as info:
        runner.bf16_source(w4a8, other)
    assert "--compare-bf16" not in str(info.value) and "recorded in" not in str(info.value)
    with pytest.raises(AnychipError, match=r"^--compare-bf16: the BF16 source .* is gone"):
        runner.bf16_source(w4a8)
    shard = next(moved.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes() + b"\0")
    with pytest.raises(AnychipError, match="names or sizes differ"):
        runner.bf16_source(w4a8, moved)

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was started")

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(runner, "evaluate_all", no_engine)
    try:
        assert main(["eval", str(w4a8), "--bf16", str(moved), "--tasks", "perplexity", "--verify", "none"]) == 2
    finally:
        monkeypatch.undo()
    assert "names or sizes differ" in capsys.readouterr().err


def test_a_quantized_model_of_another_kind_is_labelled_by_its_method(tmp_path):
    model = tmp_path / "gptq"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq", "bits": 4}}))
    assert runner.models_to_evaluate(model, compare_bf16=False) == {"gptq": model}


def test_reserved_and_empty_task_selections_are_refused(tmp_path):
    (tmp_path / "perplexity.jsonl").write_text('{"context": "c", "choices": [" a", " b"], "label": 0}\n')
    with pytest.raises(EvalDataError, match="'perplexity' is the name of the text perplexity task"):
        select_tasks(None, tmp_path)
    with pytest.raises(EvalDataError, match="--tasks names no task"):
        select_tasks([], None)


def test_the_json_report_has_no_nan_and_cis_stay_within_accuracy_bounds():
    from anychip.eval.scoring import paired_delta

    assert runner._no_nan({"a": float("nan"), "b": [1.0, float("nan")]}) == {"a": None, "b": [1.0, None]}
    m, lo, hi = paired_delta([1.0, 1.0, 0.0], [0.0, 0.0, 1.0])  # n = 3: the normal interval passes +-1
    assert -1.0 <= lo <= m <= hi <= 1.0


def test_eval_flags_that_would_be_lost_are_refused_or_merged(tmp_path, monkeypatch, capsys):
    """--text without the perplexity task is refused; repeated --tasks flags add up and a name given twice is
    scored once; --harness lm-eval checks --json before any engine, refuses an empty --tasks, and writes null
    where lm-eval reports NaN (one item's stderr)."""
    from anychip.cli import main
    from anychip.eval import harness

    model = tmp_path / "model"
    assert main(["eval", str(model), "--tasks", "copa", "--text", str(tmp_path / "x.txt")]) == 2
    assert "add 'perplexity' to --tasks" in capsys.readouterr().err
    seen = {}

    def fake_cmd_eval(args):
        seen["tasks"] = args.tasks
        return 0

    monkeypatch.setattr(runner, "cmd_eval", fake_cmd_eval)
    monkeypatch.delenv("VLLM_LOGGING_STREAM", raising=False)
    assert main(["eval", str(model), "--tasks", "piqa,copa", "--tasks", "piqa", "--tasks", "boolq"]) == 0
    assert seen["tasks"] == ["piqa", "copa", "boolq"]
    assert os.environ["VLLM_LOGGING_STREAM"] == "ext://sys.stderr"  # stdout: the results table alone

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was started")

    run_lm_eval = harness.run_lm_eval
    monkeypatch.setattr(harness, "run_lm_eval", no_engine)
    assert main(["eval", str(model), "--harness", "lm-eval", "--tasks", "copa", "--json", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    with pytest.raises(EvalDataError, match="--tasks names no task"):
        run_lm_eval(model, [], runner.EvalSettings(), False)
    report = {"models": {"w4a8": str(model)}, "tasks": {"copa": {"w4a8": {"acc": 1.0, "acc_norm": 1.0, "n": 1,
                                                                           "acc_stderr": float("nan")}}}}
    monkeypatch.setattr(harness, "run_lm_eval", lambda *args, **kwargs: report)
    monkeypatch.setattr(runner, "verify_model", lambda *args: None)
    out = tmp_path / "lm.json"
    assert main(["eval", str(model), "--harness", "lm-eval", "--tasks", "copa", "--json", str(out)]) == 0
    saved = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the JSON report"))
    assert saved["tasks"]["copa"]["w4a8"]["acc_stderr"] is None


def test_the_table_gives_both_paired_cis_and_says_when_no_item_differs():
    from anychip.eval.scoring import TaskScore, compare

    a = TaskScore((True, False, True, True), (True, True, False, True))
    b = TaskScore((True, True, False, True), (True, True, False, True))
    d = compare(a, b)
    assert d["acc_discordant"] == 2 and d["acc_norm_discordant"] == 0
    report = {"models": {"w4a8": "w", "bf16": "b"}, "tasks": {"boolq": {
        "w4a8": {"acc": 0.75, "acc_norm": 0.75, "n": 4}, "bf16": {"acc": 0.75, "acc_norm": 0.75, "n": 4},
        "deltas": {"w4a8 - bf16": d}}}}
    line = runner.format_report(report).splitlines()[-1]
    assert line.count("[") == 2 and "no item scored differently" not in line
    same = compare(b, b)
    report["tasks"]["boolq"]["deltas"]["w4a8 - bf16"] = same
    assert "no item scored differently" in runner.format_report(report)


def test_settings_fit_the_shortest_model_context(tmp_path):
    """A model whose config allows fewer positions than eval's 2048 gets sequences, and perplexity windows, that
    fit it (vLLM refuses to start with a longer max_model_len); models with room, or no say, change nothing."""
    dirs = []
    for name, config in (("short", {"max_position_embeddings": 256}), ("long", {"max_position_embeddings": 8192}),
                         ("unsaid", {})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        dirs.append(tmp_path / name)
    base = runner.EvalSettings(limit=3)
    fitted = runner.fit_context(base, dirs)
    assert (fitted.max_len, fitted.window, fitted.stride, fitted.limit) == (255, 255, 127, 3)
    assert runner.fit_context(base, dirs[1:]) == base
    assert runner.fit_context(runner.EvalSettings(window=128, stride=32), dirs[:1]).window == 128


@pytest.mark.slow
def test_eval_through_vllm_on_a_model_with_a_short_context(tiny_llama, tmp_path, capsys):
    """`anychip eval --compare-bf16` end to end on a W4A8 model (and its BF16 source) that allows 256 positions:
    it used to fail at vLLM's start (max_model_len 2048 > 256)."""
    from anychip.checkpoint.quantize import quantize_checkpoint
    from anychip.checkpoint.scheme import W4A8Scheme
    from anychip.cli import main

    src = tiny_llama(hidden_size=128)
    assert json.loads((src / "config.json").read_text())["max_position_embeddings"] == 256
    w4a8 = quantize_checkpoint(src, tmp_path / "w4a8", W4A8Scheme(32))
    data = tmp_path / "tasks"
    data.mkdir()
    (data / "toy.jsonl").write_text("".join(json.dumps({"context": " ".join(f"w{i % 97}" for i in range(300)),
                                                        "choices": [" w3 w4", " w5"], "label": i % 2}) + "\n"
                                            for i in range(4)))
    text = tmp_path / "words.txt"
    text.write_text(" ".join(f"w{(i * 7) % 97}" for i in range(700)))
    out = tmp_path / "report.json"
    assert main(["eval", str(w4a8), "--data", str(data), "--tasks", "toy,perplexity", "--text", str(text),
                 "--compare-bf16", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (report["settings"]["max_len"], report["settings"]["window"], report["settings"]["stride"]) == (255, 255,
                                                                                                            127)
    from transformers import AutoTokenizer

    n_tokens = len(AutoTokenizer.from_pretrained(src).encode(text.read_text(), add_special_tokens=False))
    assert n_tokens > 255  # several windows
    assert report["tasks"]["toy"]["w4a8"]["n"] == 4
    assert report["tasks"]["perplexity"]["w4a8"]["tokens"] == n_tokens - 1  # every token but the first, once
    assert "context is 256 tokens" in capsys.readouterr().err


@pytest.mark.slow
def test_eval_default_model_through_vllm(default_model, tmp_path):
    """--limit 20 on commonsense_qa with the default BF16 model through vLLM, plus a short perplexity text."""
    text = tmp_path / "short.txt"
    text.write_text(Path(runner.__file__).resolve().parents[1].joinpath("data", "kjv_mark.txt")
                    .read_text(encoding="utf-8")[:6000])
    settings = runner.EvalSettings(limit=20, window=256, stride=128)
    report = runner.run_eval(default_model.bf16_dir, ["commonsense_qa", "perplexity"], None, settings, False,
                             str(text))
    cqa = report["tasks"]["commonsense_qa"]["bf16"]
    assert cqa["n"] == 20 and 0.0 <= cqa["acc"] <= 1.0 and 0.0 <= cqa["acc_norm"] <= 1.0
    ppl = report["tasks"]["perplexity"]["bf16"]["ppl"]
    assert 1.0 < ppl < 200.0  # SmolLM2-135M reads English: far below the vocabulary size (49152)


def test_torch_engine_on_a_w4a8_checkpoint_matches_the_reference_model(tmp_path):
    """The simulated W4A8 linears (fp32 accumulation) agree with checkpoint.torch_model's exact INT32 reference."""
    import torch
    from conftest import write_tiny_llama

    from anychip.checkpoint.quantize import quantize_checkpoint
    from anychip.checkpoint.scheme import W4A8Scheme
    from anychip.checkpoint.torch_model import load_reference_model
    from anychip.eval.engines import TorchEngine

    src = write_tiny_llama(tmp_path / "bf16")
    dst = quantize_checkpoint(src, tmp_path / "w4a8", W4A8Scheme(group_size=32))
    engine = TorchEngine.from_dir(dst, dtype=torch.float32)
    seqs = [[3, 5, 7, 11, 13], [2, 4, 6]]
    got = engine.token_logprobs(seqs, desc="tiny")
    ref = load_reference_model(dst, dtype=torch.float32)
    with torch.inference_mode():
        for seq, lp in zip(seqs, got):
            logits = ref(input_ids=torch.tensor([seq])).logits.float()
            want = torch.log_softmax(logits[0, :-1], -1).gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
            assert lp == pytest.approx(want.tolist(), abs=1e-3)


@pytest.mark.slow
def test_cli_eval_w4a8_with_compare_bf16(default_model, tmp_path, capsys):
    """The front door end to end: the prepared W4A8 model through vLLM + the plugin, its BF16 source, a JSON report."""
    from anychip.cli import main

    out = tmp_path / "eval.json"
    assert main(["eval", str(default_model.w4a8_dir), "--tasks", "commonsense_qa", "--limit", "5", "--compare-bf16",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    entry = report["tasks"]["commonsense_qa"]
    assert entry["w4a8"]["n"] == entry["bf16"]["n"] == 5
    assert set(entry["delta"]) >= {"acc", "acc_norm", "acc_norm_ci95"}
    assert report["models"] == {"w4a8": str(default_model.w4a8_dir), "bf16": str(default_model.bf16_dir)}
    assert "delta" in capsys.readouterr().out


def test_eval_and_bench_check_a_w4a8_checkpoint_before_any_engine(tiny_llama, tmp_path, monkeypatch, capsys):
    """A W4A8 checkpoint whose files no longer match SHA256SUMS is refused by eval and bench latency as by serve
    (--verify full by default), naming the file and the way around it; --verify none runs it, saying so."""
    from anychip.checkpoint.quantize import quantize_checkpoint
    from anychip.checkpoint.scheme import W4A8Scheme
    from anychip.cli import main

    d = quantize_checkpoint(tiny_llama(), tmp_path / "w4a8", W4A8Scheme(64))
    with open(d / "model.safetensors", "r+b") as f:
        f.seek(-3, 2)
        byte = f.read(1)
        f.seek(-3, 2)
        f.write(bytes([byte[0] ^ 0x40]))
    monkeypatch.setattr(runner, "evaluate_all", lambda *a, **k: pytest.fail("an engine was started"))
    text = tmp_path / "t.txt"
    text.write_text("w1 w2 w3 " * 50)
    for argv in (["eval", str(d), "--tasks", "perplexity", "--text", str(text)],
                 ["bench", "latency", str(d), "--pp", "8", "--tg", "2", "--reps", "1"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "model.safetensors: sha256" in err and "--verify none skips that" in err, err
    with pytest.raises(BaseException, match="an engine was started"):
        main(["eval", str(d), "--tasks", "perplexity", "--text", str(text), "--verify", "none"])
    out = capsys.readouterr()  # the verify line on stderr: stdout holds the table alone
    assert "verify    skipped (--verify none)" in out.err and "verify" not in out.out
