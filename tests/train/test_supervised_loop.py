"""The one supervised loop and teacher-forced evaluation."""

import torch

from birkhoff.engine import Engine, SamplingParams
from birkhoff.presets import tiny_cpu
from birkhoff.rl.loop import GRPORun
from birkhoff.tasks.batches import prompt_ids
from birkhoff.tasks.problems import get_task, held_out_rng, sample_problems
from birkhoff.tokenizer import CharTokenizer
from birkhoff.train.loop import supervised_steps, teacher_forced_accuracy
from birkhoff.train.optim import build_optimizer
from birkhoff.train.recompute import build_model


def test_teacher_forced_accuracy_equals_greedy_generation_exact_match():
    preset, tok = tiny_cpu(), CharTokenizer()
    task = get_task(preset.task, **preset.task_options)
    cfg = preset.train.replace(num_steps=40)
    torch.manual_seed(0)
    model = build_model(preset.model, cfg, device=torch.device("cpu"))
    optimizer = build_optimizer(model, cfg)
    for _ in supervised_steps(model, optimizer, task, tok, cfg, steps=range(40)):
        pass
    model = model.double()
    problems = sample_problems(task, held_out_rng(0), 64)
    accuracy = teacher_forced_accuracy(model, problems, tok)
    engine = Engine.from_model(model, dtype=torch.float64, max_batch_size=64)
    params = SamplingParams(4, temperature=0.0, stop_token_ids=(tok.eos_id,))
    completions = engine.generate([prompt_ids(p, tok) for p in problems], params)
    hits = [p.answer == tok.decode(c.tokens) for p, c in zip(problems, completions, strict=True)]
    assert 0.05 < accuracy < 0.95  # partly learned, so the comparison means something
    assert accuracy == sum(hits) / len(hits)


def test_the_grpo_warm_up_is_the_supervised_loop(tmp_path):
    preset = tiny_cpu()
    rl = preset.rl.replace(warmup_steps=3, num_steps=0, num_eval_prompts=0)
    run = GRPORun(preset.replace(rl=rl), tmp_path, device="cpu")
    warm = [r for r in run.run(progress=False) if r["phase"] == "sft"]
    cfg = preset.train.replace(num_steps=3)
    torch.manual_seed(cfg.seed)
    model = build_model(preset.model, cfg, device=torch.device("cpu"))
    task = get_task(preset.task, **preset.task_options)
    rows = list(supervised_steps(model, build_optimizer(model, cfg), task, CharTokenizer(), cfg,
                                 steps=range(3)))  # fmt: skip

    def numbers(r):  # the run also counts its skipped steps (skipped_total)
        r = {k: v for k, v in r.items() if k != "skipped_total"}
        return {k: v for k, v in r.items() if not k.endswith("_s") and not k.startswith("mem_")}

    assert [numbers(r) for r in warm] == [numbers(r) for r in rows]
