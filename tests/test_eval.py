"""``meshtron eval``: lm-evaluation-harness on a checkpoint gives what lm-eval's own Hugging Face backend
(``HFLM``) gives on the same model exported with ``export-hf`` -- per-request log-likelihoods within
1e-4, a local multiple-choice task's accuracy within one example -- on one device and on a 2x2x2
mesh; its batched greedy generation equals meshtron's one-sequence sampler's; its results file is
lm-eval's JSON, written new. The tasks are local YAMLs with local data (tests/fixtures/eval_tasks):
nothing is downloaded. Skipped without lm-eval (the ``eval`` extra) or torch/transformers.
"""

import functools
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

lm_eval = pytest.importorskip("lm_eval")

from meshtron.cli import main
from meshtron.config import MeshConfig
from meshtron.huggingface import export_hf, import_hf
from meshtron.pretrained import load_pretrained

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "tests" / "fixtures" / "eval_tasks"
CHOICE, CONTINUE = "meshtron_tiny_choice", "meshtron_tiny_continue"
EXAMPLES = sum(1 for _ in (TASKS / "choice.jsonl").open())


@pytest.fixture(scope="module", autouse=True)
def task_index_once():
    """lm-eval's task index built once per include path for this module's tests: a ``TaskManager`` indexes
    lm-eval's ~15,000 built-in task YAMLs as it is made (seconds each time) and ``meshtron eval`` makes one
    a run; what it finds is the same for every run here."""
    import lm_eval.tasks

    made, make = {}, lm_eval.tasks.TaskManager

    def once(*args, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        if key not in made:
            made[key] = make(*args, **kwargs)
        return made[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lm_eval.tasks, "TaskManager", once)
        yield


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A random tiny Llama with a BPE tokenizer: imported into meshtron, and exported back (what HFLM reads)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from meshtron.data.tokenizers import train_bpe

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("eval")
    hf_dir = root / "hf"
    hf_dir.mkdir()
    text = root / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog; the dog sleeps. " * 40)
    tokenizer = train_bpe([text], 300, hf_dir / "tokenizer.json", min_frequency=1)
    config = transformers.LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0,
                                      eos_token_id=tokenizer.eod, bos_token_id=tokenizer.eod)
    llama = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in llama.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    llama.save_pretrained(hf_dir)
    checkpoint = import_hf(hf_dir, root / "meshtron")
    exported = export_hf(checkpoint, root / "exported")
    return checkpoint, exported


@pytest.fixture(scope="module")
def hflm(model):
    pytest.importorskip("accelerate")  # lm-eval's Hugging Face backend imports it (the hf extra)
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(model[1]), device="cpu", batch_size=8, dtype="float32")


@pytest.fixture
def in_repo(monkeypatch):
    monkeypatch.chdir(ROOT)  # the task YAMLs name their data files from the repository's root


def requests(kind: str, pairs):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=args, idx=i) for i, args in enumerate(pairs)]


PAIRS = [("the quick brown", " fox"), ("the lazy", " dog sleeps"), ("the dog", " jumps over the lazy dog"),
         ("", "the fox"), ("over the", " lazy dog; the dog sleeps. the quick brown fox jumps")]


def accuracy(results: dict) -> float:
    return results["results"][CHOICE]["acc,none"]


@functools.cache  # once for the one-device and the 2x2x2 test: the same model (the module's HFLM), the same task
def hf_accuracy(hflm) -> float:
    from lm_eval.tasks import TaskManager

    return accuracy(lm_eval.simple_evaluate(model=hflm, tasks=[CHOICE], task_manager=TaskManager(include_path=str(TASKS))))


def check_against_hflm(model, hflm, mesh: tuple[int, int, int], tmp_path) -> None:
    from meshtron.evaluation import MeshtronLM

    checkpoint, _ = model
    ours = MeshtronLM(load_pretrained(checkpoint, MeshConfig(*mesh)), batch_size=4)
    theirs_ll = hflm.loglikelihood(requests("loglikelihood", PAIRS))
    ours_ll = ours.loglikelihood(requests("loglikelihood", PAIRS))
    assert [g for _, g in ours_ll] == [g for _, g in theirs_ll]
    np.testing.assert_allclose([v for v, _ in ours_ll], [v for v, _ in theirs_ll], atol=1e-4, rtol=0)
    assert min(v for v, _ in ours_ll) < -5  # the scores are not trivially small
    texts = [(c + t,) for c, t in PAIRS]
    np.testing.assert_allclose(ours.loglikelihood_rolling(requests("loglikelihood_rolling", texts)),
                               hflm.loglikelihood_rolling(requests("loglikelihood_rolling", texts)), atol=1e-4, rtol=0)

    output = tmp_path / "results.json"
    args = ["eval", str(checkpoint), "--tasks", CHOICE, "--include-path", str(TASKS), "--batch-size", "4",
            "--seed", "5,None,9", "--output", str(output),
            *(f"parallel.{a}={n}" for a, n in zip(("data", "pipe", "tensor"), mesh))]
    assert main(args) == 0
    written = json.loads(output.read_text())
    seeds = [written["config"][f"{k}_seed"] for k in ("random", "numpy", "torch", "fewshot")]
    assert seeds == [5, None, 9, 1234]  # lm-eval's --seed: a missing fourth is its default
    assert written["results"][CHOICE]["alias"] == CHOICE and written["n-samples"][CHOICE]["effective"] == EXAMPLES
    assert abs(accuracy(written) - hf_accuracy(hflm)) <= 1 / EXAMPLES + 1e-9


def test_eval_equals_lm_evals_hugging_face_backend(model, hflm, tmp_path, in_repo):
    check_against_hflm(model, hflm, (1, 1, 1), tmp_path)


@pytest.mark.slow
def test_eval_equals_lm_evals_hugging_face_backend_on_2x2x2(model, hflm, tmp_path, in_repo):
    check_against_hflm(model, hflm, (2, 2, 2), tmp_path)


@pytest.mark.slow
def test_batched_generation_equals_the_sampler_on_any_mesh(model, hflm, in_repo):
    """generate_until, batched (prompts of different lengths, KV cache on 1 device; full window with
    pipe=2, rows split over data), gives the one-sequence sampler's greedy text, cut at the stop string,
    and HFLM's."""
    from meshtron.evaluation import MeshtronLM
    from meshtron.generate import sample

    checkpoint, _ = model
    prompts = [json.loads(line)["prompt"] for line in (TASKS / "continue.jsonl").open()]
    settings = {"until": ["."], "max_gen_toks": 6, "do_sample": False}
    single = load_pretrained(checkpoint, MeshConfig(1, 1, 1))
    expected = []
    for prompt in prompts:
        text = sample(single, single.tokenizer.encode(prompt), max_new_tokens=6, stop=[]).continuation
        expected.append(text.split(".")[0].split(single.tokenizer.decode([single.tokenizer.eod]))[0])
    assert hflm.generate_until(requests("generate_until", [(p, settings) for p in prompts])) == expected
    assert len(set(map(len, expected))) > 1  # texts cut at different lengths
    for mesh in [(1, 1, 1), (2, 2, 2)]:
        ours = MeshtronLM(load_pretrained(checkpoint, MeshConfig(*mesh)), batch_size=4)
        assert ours.generate_until(requests("generate_until", [(p, settings) for p in prompts])) == expected
        assert ours.decoder().use_cache == (mesh[1] == 1) and ours.decoder().traces == 2


def test_sampled_generation_is_seeded_whatever_the_batch_and_the_samplers(model, in_repo):
    """generate_until with do_sample / temperature / top_k / top_p: each request gives the one-sequence
    sampler's text for its request_seed, the same again, with another batch size and among other requests
    (another order, a repeated copy); another seed gives other text; temperature 0, do_sample false and
    top_k 1 are greedy."""
    from meshtron.evaluation import MeshtronLM, request_seed
    from meshtron.generate import Sampler

    checkpoint, _ = model
    single = load_pretrained(checkpoint, MeshConfig(1, 1, 1))
    prompts = [json.loads(line)["prompt"] for line in (TASKS / "continue.jsonl").open()]
    sampled = {"until": ["."], "max_gen_toks": 6, "do_sample": True, "temperature": 1.5, "top_k": 60, "top_p": 0.95}
    eos = single.tokenizer.decode([single.tokenizer.eod])
    sampler = Sampler(single.model_def, single.mesh, execution=single.execution)

    def reference(seed, **settings):
        return [sampler.sample(single.params, single.tokenizer.encode(p), max_new_tokens=6, stop=[], seed=seed(i),
                               tokenizer=single.tokenizer,
                               **settings).continuation.split(".")[0].split(eos)[0] for i, p in enumerate(prompts)]

    def run(lm, settings):
        return lm.generate_until(requests("generate_until", [(p, settings) for p in prompts]))

    ours = MeshtronLM(single, batch_size=4, seed=7)
    reqs = requests("generate_until", [(p, sampled) for p in prompts])
    expected = reference(lambda i: request_seed(7, reqs[i]), temperature=1.5, top_k=60, top_p=0.95)
    greedy = reference(lambda i: 0)
    assert expected != greedy
    assert run(ours, sampled) == expected and run(ours, sampled) == expected
    assert run(MeshtronLM(single, batch_size=3, seed=7), sampled) == expected  # other batches, other rows
    # fewer requests, in another order, the first one twice (lm-eval's repeats): the copy draws anew
    again = ours.generate_until([reqs[3], reqs[0], reqs[1], reqs[0]])
    assert again[:3] == [expected[3], expected[0], expected[1]] and again[3] != expected[0]
    assert run(MeshtronLM(single, batch_size=4, seed=8), sampled) != expected
    assert run(ours, {**sampled, "temperature": 0.0}) == greedy
    assert run(ours, {**sampled, "do_sample": False}) == greedy  # lm-eval: do_sample false means greedy
    assert run(ours, {**sampled, "top_k": 1}) == greedy
    assert ours.decoder().traces == 2


def test_do_sample_without_a_temperature_is_greedy_as_lm_evals():
    """lm-eval reads an absent temperature as 0 whatever ``do_sample`` says (its ``normalize_gen_kwargs``,
    HFLM's generate): greedy, not an error."""
    pytest.importorskip("lm_eval")
    from meshtron.evaluation import generation_settings

    assert generation_settings({"do_sample": True, "until": "."}, 16, 300) == {
        "until": ["."], "max_gen_toks": 16, "temperature": 0.0, "top_k": None, "top_p": 1.0}
    assert generation_settings({"do_sample": True, "temperature": 0.7, "top_k": 0}, 16, 300)["temperature"] == 0.7


@pytest.mark.parametrize("settings, message", [
    ({"until": ["."], "num_beams": 4}, "generation_kwargs: num_beams not supported by meshtron eval"),
    ({"do_sample": True, "temperature": 1.0, "top_p": 2}, "generation_kwargs: top_p: must be a number in (0, 1]"),
    ({"do_sample": True, "temperature": -1}, "generation_kwargs: temperature: must be >= 0"),
    ({"do_sample": True, "temperature": 1, "top_k": 2.5}, "generation_kwargs: top_k: must be an integer"),
])
def test_bad_generation_kwargs_are_one_line(model, settings, message):
    from meshtron.errors import ConfigError
    from meshtron.evaluation import MeshtronLM

    ours = MeshtronLM(load_pretrained(model[0], MeshConfig(1, 1, 1)), batch_size=2)
    with pytest.raises(ConfigError) as caught:
        ours.generate_until(requests("generate_until", [("the dog", settings)]))
    assert message in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.slow
def test_generation_task_runs_and_results_are_written_new(model, tmp_path, in_repo, capsys):
    checkpoint, _ = model
    output = tmp_path / "results.json"
    args = ["eval", "--checkpoint", str(checkpoint), "--tasks", f"{CONTINUE},{CHOICE}", "--include-path", str(TASKS),
            "--limit", "3", "--output", str(output)]
    assert main(args) == 0
    written = json.loads(output.read_text())
    assert set(written["results"]) == {CHOICE, CONTINUE} and "exact_match,none" in written["results"][CONTINUE]
    assert written["n-samples"][CONTINUE]["effective"] == 3
    assert f"{CONTINUE}: exact_match" in capsys.readouterr().out
    # an existing file is not replaced unless asked
    assert main(args) == 2
    assert "exists; give a new file (or --overwrite" in capsys.readouterr().err
    assert not list(tmp_path.glob(".*partial"))
    # sampling a greedy task (lm-eval's --gen_kwargs), seeded: the same results again
    sampled = [*args[:-2], "--tasks", CONTINUE, "--gen-kwargs", "do_sample=True,temperature=2.0,top_k=40", "--seed",
               "3", "--output"]
    runs = []
    for name in ("a.json", "b.json"):
        assert main([*sampled, str(tmp_path / name)]) == 0
        runs.append(json.loads((tmp_path / name).read_text()))
    assert runs[0]["results"] == runs[1]["results"] and runs[0]["config"]["torch_seed"] == 3
    assert runs[0]["configs"][CONTINUE]["generation_kwargs"]["temperature"] == 2.0



def test_the_adapter_is_registered_with_lm_eval():
    from lm_eval.api.registry import get_model

    from meshtron.evaluation import MeshtronLM

    assert get_model("meshtron") is MeshtronLM


@pytest.mark.parametrize("extra, message", [
    pytest.param(["--tasks", "no_such_task"], "--tasks: no_such_task: no such lm-eval task",
                 marks=pytest.mark.slow),  # indexes lm-eval's own tasks
    (["--tasks", CHOICE, "--include-path", "/nonexistent"], "--include-path: /nonexistent: no such directory"),
    (["--tasks", CHOICE, "--batch-size", "0"], "--batch-size: must be >= 1"),
    (["--tasks", CHOICE, "--seed", "1,x,3"], "--seed: '1,x,3': give one integer >= 0"),
    (["--tasks", CHOICE, "--seed", "1,2"], "--seed: '1,2': give one integer >= 0"),
    (["--tasks", CHOICE, "--gen-kwargs", "num_beams=2"], "--gen-kwargs: num_beams not supported by meshtron eval"),
    (["--tasks", CHOICE, "--gen-kwargs", "temperature"], "--gen-kwargs: 'temperature': give key=value pairs"),
])
def test_bad_eval_arguments_are_one_line(model, extra, message, capsys, in_repo):
    assert main(["eval", str(model[0]), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_without_the_extra_eval_says_how_to_install_it(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    assert main(["eval", str(tmp_path), "--tasks", CHOICE]) == 2
    assert capsys.readouterr().err == "meshtron: error: meshtron eval needs lm-evaluation-harness: pip install meshtron[eval]\n"
