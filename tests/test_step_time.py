"""The executor's own step-time fit (schedule_from_step_time): the knobs it sets from a + b x tokens, what it leaves
alone, and that it runs on the real step loop."""

from __future__ import annotations

import random

from kiln.runtime.scheduler import SchedulerConfig
from kiln.runtime.step_time import StepTimeKnobs, amortized_budget


def config(**kw) -> SchedulerConfig:
    return SchedulerConfig(max_batch_size=64, max_num_tokens=2048, max_seq_len=2048, max_input_len=2047, **kw)


def feed(knobs: StepTimeKnobs, a: float, b: float, sizes, noise: float = 0.0, seed: int = 0) -> None:
    rng = random.Random(seed)
    for n in sizes:
        knobs.observe(n, (a + b * n) * (1 + rng.uniform(-noise, noise)))


def test_the_fit_sets_the_decoding_budget_and_the_lead():
    c = config()
    knobs = StepTimeKnobs(c, block=16)
    a, b = 0.012, 0.0005
    sizes = [1, 3, 8, 2048, 5, 700, 12, 256] * 4
    feed(knobs, a, b, sizes, noise=0.02)
    fit = knobs.as_dict()
    assert abs(fit["step_fixed_s"] - a) < 0.002 and abs(fit["per_token_s"] - b) < 2e-5
    assert amortized_budget(a, b) == 216
    assert c.decoding_max_num_tokens in (208, 224, 240)                 # 9 a / b, block-aligned, from a noisy fit
    assert abs(c.short_prompt_lead_s - b * 2047) < 0.05                 # the longest prompt's prefill time


def test_nothing_changes_before_the_steps_can_tell_a_from_b():
    c = config()
    knobs = StepTimeKnobs(c, block=16)
    feed(knobs, 0.012, 0.0005, [1, 2048, 1])                            # fewer than MIN_ROWS steps: no fit yet
    assert knobs.as_dict() is None
    knobs = StepTimeKnobs(c, block=16)
    feed(knobs, 0.012, 0.0005, [8] * 64)                                # one size only: no fit
    assert knobs.as_dict() is None and c.decoding_max_num_tokens is None and c.short_prompt_lead_s == 0.0
    feed(knobs, 0.012, 0.0005, [1, 2048, 1])                            # other sizes, but the refit is every 4 steps
    assert knobs.as_dict() is None
    feed(knobs, 0.012, 0.0005, [2048])                                  # the 4th: the window's sizes now differ
    assert knobs.as_dict() is not None and c.decoding_max_num_tokens is not None


def test_given_knobs_stay_and_a_budget_that_would_be_the_whole_step_is_none():
    c = config(decoding_max_num_tokens=512, short_prompt_lead_s=3.0)
    knobs = StepTimeKnobs(c, block=16, fixed=frozenset({"decoding_max_num_tokens", "short_prompt_lead_s"}))
    feed(knobs, 0.012, 0.0005, [1, 2048, 8, 700] * 8)
    assert knobs.as_dict() is not None
    assert c.decoding_max_num_tokens == 512 and c.short_prompt_lead_s == 3.0
    c = config()
    knobs = StepTimeKnobs(c, block=16)
    feed(knobs, 0.5, 0.0001, [1, 2048, 8, 700] * 8)                     # 9 a / b = 45000 > 2048: no cap
    assert c.decoding_max_num_tokens is None and c.short_prompt_lead_s > 0
    c = config()
    knobs = StepTimeKnobs(c, block=16)
    feed(knobs, 0.0001, 0.001, [1, 2048, 8, 700] * 8)                   # 9 a / b ~ 1: a full batch of decodes + a block
    assert c.decoding_max_num_tokens == 64 - 1 + 16


def test_the_executor_fits_its_own_steps(checkpoint_dir):
    from kiln.runtime import LLM, SamplingParams

    from runtime_support import get_engine

    engine = get_engine(checkpoint_dir("llama"))
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 500) for _ in range(rng.randrange(2, 90))] for _ in range(40)]
    with LLM(engine, schedule_from_step_time=True) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        for p in prompts[:8]:   # more steps of other sizes, one prompt at a time
            llm.generate([p], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        cfg = llm.stats()["config"]
    assert all(len(o.token_ids) == 12 for o in outs)
    fit = cfg["step_time_fit"]
    assert fit is not None and fit["step_fixed_s"] > 0 and fit["per_token_s"] > 0
    bounds = engine.config.bounds
    assert abs(cfg["short_prompt_lead_s"] - fit["per_token_s"] * bounds.max_input_len) < 1e-9
    d = cfg["decoding_max_num_tokens"]
    assert d is None or bounds.max_batch_size - 1 + bounds.tokens_per_block <= d < bounds.max_num_tokens


def test_by_default_the_fit_sets_the_lead_and_the_pace_but_no_decoding_budget(checkpoint_dir):
    from kiln.runtime import LLM, SamplingParams

    from runtime_support import get_engine

    engine = get_engine(checkpoint_dir("llama"))
    rng = random.Random(4)
    prompts = [[rng.randrange(5, 500) for _ in range(rng.randrange(2, 90))] for _ in range(24)]
    with LLM(engine) as llm:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        for p in prompts[:8]:
            llm.generate([p], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        cfg = llm.stats()["config"]
        sched = llm.executor.scheduler.config
    fit = cfg["step_time_fit"]
    assert fit is not None and sched.step_time == (fit["step_fixed_s"], fit["per_token_s"])
    assert cfg["tpot_target_s"] == 0.1 and cfg["decoding_max_num_tokens"] is None
    assert abs(cfg["short_prompt_lead_s"] - fit["per_token_s"] * engine.config.bounds.max_input_len) < 1e-9
    with LLM(engine) as llm:   # generate's requests are not paced (nobody reads their tokens as they come)
        paced = []
        real = llm.executor.submit
        llm.executor.submit = lambda *a, **k: paced.append(k.get("paced", True)) or real(*a, **k)
        llm.generate(prompts[:2], SamplingParams(max_tokens=2))
        list(llm.stream(prompts[0], SamplingParams(max_tokens=2)))
    assert paced == [False, False, True]
    with LLM(engine, short_prompt_lead_s=0, tpot_target_s=0) as llm:   # first come, first served, unpaced
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        cfg = llm.stats()["config"]
        assert llm.executor.scheduler.config.step_time is None
    assert cfg["short_prompt_lead_s"] == 0 and "step_time_fit" not in cfg


def test_refits_every_few_steps_until_fitted_on_a_window_then_seldom():
    """Every 4 steps from the 4th until the fit has 64 steps behind it (the decode pace has nothing to go by before
    its first fit), then every 64: a refit reads the whole window, which every 4 steps cost the step loop ~40 us."""
    c = config()
    knobs = StepTimeKnobs(c, block=16)
    fits = []
    real = knobs._refit

    def counted():
        fits.append(len(knobs.rows))
        real()

    knobs._refit = counted
    feed(knobs, 0.012, 0.0005, [1, 2048, 8, 700])           # 4 steps: the first refit comes with MIN_ROWS
    assert fits == [4] and knobs.as_dict() is not None
    feed(knobs, 0.012, 0.0005, [1, 2048, 8, 700] * 15)      # every 4 steps while fewer than 64
    assert fits == list(range(4, 61, 4))
    feed(knobs, 0.012, 0.0005, [1, 2048, 8, 700] * 14 + [1, 2048, 8])   # 59 more (63 since the last): not yet
    assert len(fits) == 15
    feed(knobs, 0.012, 0.0005, [700])                       # the 64th step since the last
    assert fits[-1] == 124


def test_every_fit_reaches_the_scheduler_even_with_both_knobs_fixed():
    c = config()
    knobs = StepTimeKnobs(c, block=16, fixed=frozenset({"decoding_max_num_tokens", "short_prompt_lead_s"}))
    assert c.step_time is None
    feed(knobs, 0.012, 0.0005, [1, 2048, 8, 700] * 8)
    a, b = c.step_time
    assert abs(a - 0.012) < 1e-6 and abs(b - 0.0005) < 1e-9
    assert c.decoding_max_num_tokens is None and c.short_prompt_lead_s == 0.0


def test_before_the_first_fit_the_largest_step_stands_in():
    """A first burst of full prompts: every step is about as large, a and b cannot be told apart yet, but the pace
    needs a time per token at once; the largest step's (its fixed cost spread over its tokens) stands in."""
    c = config()
    knobs = StepTimeKnobs(c, block=16)
    knobs.observe(1500, 0.012 + 0.0005 * 1500)
    assert c.step_time == (0.0, (0.012 + 0.0005 * 1500) / 1500)
    knobs.observe(2, 0.013)                                   # a smaller step does not replace it
    knobs.observe(2048, 0.012 + 0.0005 * 2048)                # a larger one does
    assert c.step_time == (0.0, (0.012 + 0.0005 * 2048) / 2048) and knobs.as_dict() is None
    feed(knobs, 0.012, 0.0005, [1, 2048, 8, 700] * 2)         # then the fit
    a, b = c.step_time
    assert abs(a - 0.012) < 1e-6 and abs(b - 0.0005) < 1e-9
