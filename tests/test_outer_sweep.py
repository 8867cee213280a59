"""bench/outer_sweep.py: the in-process DiLoCo emulator does the node's round arithmetic, resumes,
and refuses bad flags with one line. Socket-free: fake peer ids, a small synthetic corpus."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import outer_sweep  # noqa: E402
from lowcomm.node.data import Corpus  # noqa: E402
from lowcomm.node.trainer import Trainer  # noqa: E402
from lowcomm.protocol import codecs  # noqa: E402

PEERS = ["peer-b", "peer-a"]  # unsorted on purpose: the emulator orders members by id, as the leader does


def fake_ids(count: int) -> list[str]:
    return [f"peer-{i}" for i in range(count)]


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    rng = np.random.default_rng(0)
    # Skewed byte frequencies, so that a few steps lower the loss (an all-uniform text would not).
    text = rng.choice(64, size=60_000, p=np.arange(64, 0, -1) / np.arange(64, 0, -1).sum()).astype(np.uint8)
    return Corpus(train=text[:50_000], eval=text[50_000:], files=1)


def small(lr: float = 0.7, momentum: float = 0.9, seed: int = 0) -> outer_sweep.RunConfig:
    return outer_sweep.RunConfig(lr=lr, momentum=momentum, inner_steps=2, seed=seed, steps=4, peers=2,
                                 batch_size=2, seq_len=16)


def test_emulator_matches_codec_and_nesterov_by_hand(corpus: Corpus) -> None:
    """Two rounds of P=2, H=2: θ_global equals int8 with both error feedbacks, the token-weighted
    mean and Nesterov SGD written out op by op, on trainers that see the same batches."""
    torch.set_num_threads(1)
    run = small(lr=0.7, momentum=0.9)
    emulator = outer_sweep.Emulator(run, PEERS, corpus)
    emulator.train()

    config = run.workload().config(extra=run.node_sets())
    ids = sorted(PEERS)
    trainers = [Trainer(config, peer, corpus) for peer in ids]
    codec = codecs.get_codec("int8")
    theta = trainers[0].get_params()
    numel = theta.numel()
    half = round(numel / 2)
    shards = [slice(0, half), slice(half, numel)]
    sender = [torch.zeros(numel) for _ in ids]  # member i's residual of its parts of others' shards
    owner = [torch.zeros(numel) for _ in ids]  # member j's residual of the average of shard j
    buf = torch.zeros(numel)
    lr, m = torch.tensor(0.7, dtype=torch.float32), torch.tensor(0.9, dtype=torch.float32)
    for _ in range(2):
        deltas = []
        for trainer in trainers:
            trainer.train_phase(2, lambda: False)
            deltas.append(theta - trainer.get_params())
        for j, sl in enumerate(shards):
            parts = []
            for i in range(len(ids)):
                x = deltas[i][sl] + sender[i][sl]
                if i == j:
                    parts.append(x.double())  # the owner's own part, exact
                    sender[i][sl] = 0
                else:
                    sent = codec.decode(codec.encode(x), x.numel())
                    sender[i][sl] = x - sent
                    parts.append(sent.double())
            weight = float(2 * 2 * 16)  # tokens of one inner phase: equal weights
            mean = ((parts[0] * weight + parts[1] * weight) / (2 * weight)).float()
            s = mean + owner[j][sl]
            average = codec.decode(codec.encode(s), s.numel())
            owner[j][sl] = s - average
            b = buf[sl]
            b.copy_(b * m + average)
            theta[sl] -= (b * m + average) * lr
        for trainer in trainers:
            trainer.set_params(theta)

    assert torch.equal(emulator.state.params, theta)
    assert torch.equal(emulator.state.outer.buffer, buf)
    assert all(torch.equal(a, b) for a, b in zip(emulator.residuals, sender))
    assert all(torch.equal(a, b) for a, b in zip(emulator.owner_residuals, owner))
    assert emulator.tokens == 2 * 2 * (2 * 2 * 16)  # rounds × peers × one phase's tokens
    assert not torch.equal(theta, Trainer(config, ids[0], corpus).get_params())  # it did train


def test_single_reference_is_one_trainer_with_the_global_batch(corpus: Corpus) -> None:
    """``--reference single`` trains what bench/baselines/ddp.py's `single` trains (one Trainer,
    peers × batch_size sequences per step, shard key "single", the inner lr asked for) and
    evaluates it on the held-out batches the emulator evaluates θ_global on."""
    torch.set_num_threads(1)
    run = outer_sweep.RunConfig(lr=1.0, momentum=0.0, inner_steps=2, seed=0, steps=4, peers=2, batch_size=2,
                                seq_len=16, codec="fp32", inner_lr=3e-3, method="single")
    curve = outer_sweep.SingleReference(run, corpus).train()
    work = run.workload()
    config = work.config(batch_size=4, extra=run.node_sets())
    assert config.train.lr == 3e-3
    by_hand = Trainer(config, "single", corpus)
    evaluate = outer_sweep.Emulator(dataclasses.replace(run, method="diloco"), PEERS, corpus).evaluate
    expected = []
    for step in (2, 4):
        by_hand.train_phase(2, lambda: False)
        expected.append((step, step * 4 * 16, evaluate(by_hand.get_params())))
    assert [(p["step"], p["tokens"], p["eval_loss"]) for p in curve] == expected
    assert [p["outer_step"] for p in curve] == [1, 2]


def test_delayed_overlap_lands_the_result_after_d_steps_and_at_zero_is_the_blocking_round(corpus: Corpus) -> None:
    """``overlap_delay = D``: the replicas train on past the boundary and take the round's result
    D steps into the next phase (node/overlap.py's arrival merge). At D = 0 the merge lands before
    any step, so the run is the blocking one up to float rounding; at D = 1 it is not."""
    torch.set_num_threads(1)
    run = dataclasses.replace(small(lr=1.0, momentum=0.5), steps=6, codec="fp32")  # int8 would round a 1-ulp change up to a step
    blocking = outer_sweep.Emulator(run, PEERS, corpus)
    blocking.train()
    at_once = outer_sweep.Emulator(dataclasses.replace(run, overlap_delay=0), PEERS, corpus)
    at_once.train()
    assert (at_once.state.params - blocking.state.params).abs().max() < 1e-5
    assert at_once.tokens == blocking.tokens == 3 * 2 * (2 * 2 * 16)

    late = outer_sweep.Emulator(dataclasses.replace(run, overlap_delay=1), PEERS, corpus)
    seen: list[torch.Tensor] = []
    trainer = late.trainers[0]
    original = trainer.train_phase

    def recording(steps, should_stop, on_step=None):  # the local model at the start of each call
        seen.append(trainer.get_params())
        return original(steps, should_stop, on_step)

    trainer.train_phase = recording
    late.round()
    first_global = late.state.params.clone()
    local_at_send = trainer.get_params()
    late.round()
    # Round 2 of replica 0: one step from where it sent its Δ, then the shift, then H − 1 steps.
    assert [p.shape for p in seen] == [first_global.shape] * 3
    assert torch.equal(seen[1], local_at_send)
    assert late.tokens == blocking.tokens * 2 // 3
    assert not torch.allclose(late.state.params, first_global)


@pytest.mark.parametrize("stand_in", ["own", "paper", "last"])
def test_a_stand_in_at_delay_zero_is_the_blocking_round(corpus: Corpus, stand_in: str) -> None:
    """Whatever a replica trains on from, a result that lands before any step shifts it to
    θ_global: the run is the blocking one up to float rounding."""
    torch.set_num_threads(1)
    run = dataclasses.replace(small(lr=1.0, momentum=0.5), steps=6, codec="fp32")
    blocking = outer_sweep.Emulator(run, PEERS, corpus)
    blocking.train()
    emulator = outer_sweep.Emulator(dataclasses.replace(run, overlap_delay=0, overlap_stand_in=stand_in), PEERS, corpus)
    emulator.train()
    assert (emulator.state.params - blocking.state.params).abs().max() < 1e-5


def test_stand_ins_start_from_the_previewed_outer_step(corpus: Corpus) -> None:
    """own: θ_global stepped with the replica's Δ (+ residual), as the node's eager estimate;
    last: stepped with the last round's average (own Δ in the first round, which has none);
    paper: own Δ / P + the last average · (P − 1) / P. The momentum buffer is left as it is."""
    torch.set_num_threads(1)
    run = dataclasses.replace(small(lr=1.0, momentum=0.5), steps=6, overlap_delay=1)

    def previewed(emulator: outer_sweep.Emulator, grad: torch.Tensor) -> torch.Tensor:
        expected = emulator.state.params.clone()
        buf = emulator.state.outer.buffer.mul(0.5).add(grad)
        return expected.sub(buf.mul(0.5).add(grad).mul(1.0))

    last = outer_sweep.Emulator(dataclasses.replace(run, overlap_stand_in="last"), PEERS, corpus)
    delta = torch.randn(last.numel) * 1e-3
    momentum = last.state.outer.buffer.clone()
    assert torch.allclose(last.stand_in_start(0, delta), previewed(last, delta))  # no last average yet: own Δ
    assert torch.equal(last.state.outer.buffer, momentum)
    last.round()
    assert last.last_average is not None and not torch.equal(last.last_average, torch.zeros(last.numel))
    assert torch.allclose(last.stand_in_start(1, delta), previewed(last, last.last_average))

    paper = outer_sweep.Emulator(dataclasses.replace(run, overlap_stand_in="paper"), PEERS, corpus)
    paper.round()
    mix = (delta + paper.residuals[0]) / 2 + paper.last_average / 2
    assert torch.allclose(paper.stand_in_start(0, delta), previewed(paper, mix))

    own = outer_sweep.Emulator(dataclasses.replace(run, overlap_stand_in="own"), PEERS, corpus)
    own.round()
    assert torch.allclose(own.stand_in_start(1, delta), previewed(own, delta + own.residuals[1]))
    delayed = outer_sweep.Emulator(run, PEERS, corpus)
    assert torch.equal(delayed.stand_in_start(0, delta), delayed.trainers[0].get_params())
    assert dataclasses.replace(run, overlap_stand_in="paper").name().endswith("-delayed1-paper")


def test_records_before_the_inner_lr_axis_keep_their_key_and_stay_out_of_the_study() -> None:
    """A record written before inner_lr and method existed is the workload's lr and a DiLoCo run:
    resume still recognises it, and the outer sweep's table takes only such runs."""
    import outer_sweep_results as section

    old = fake_record(0.7, 0.9, 0, 1.83)
    assert outer_sweep.RunConfig.from_record(old) == outer_sweep.RunConfig(lr=0.7, momentum=0.9, inner_steps=50, seed=0)
    study = fake_record(0.7, 0.9, 1, 1.70)
    study["config"]["inner_lr"] = 2e-3
    single = fake_record(1.0, 0.0, 2, 1.60)
    single["config"].update(method="single", codec="fp32")
    assert section.group_runs([old, study, single]) == {("int8", 50, 0.7, 0.9): {0: old}}


def test_sparseloco_runs_the_nodes_method_with_its_decayed_feedback_and_clipped_mean(corpus: Corpus) -> None:
    """``--codec sparseloco`` is the node's ``[sync] method = "sparseloco"``: its codec, clipped-mean
    aggregation and no outer momentum; the member residuals are the codec's decayed accumulators."""
    torch.set_num_threads(1)
    run = dataclasses.replace(small(lr=1.5, momentum=0.0), codec="sparseloco")
    emulator = outer_sweep.Emulator(run, PEERS, corpus)
    assert emulator.config.sync.method == "sparseloco" and emulator.aggregation.rule == "clipped_mean"
    assert emulator.codec.feedback_decay == 0.95 and emulator.state.outer.momentum == 0.0
    emulator.train()
    assert all(bool(r.abs().sum() > 0) for r in emulator.residuals)  # top-k leaves most of Δ to later rounds


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_resume_skips_done_configs(tmp_path: Path, corpus: Corpus, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "sweep.jsonl"
    base = ["--steps", "2", "--H", "1", "--peers", "2", "--batch-size", "2", "--seq-len", "16",
            "--json-out", str(out), "--eval-every", "2"]
    assert outer_sweep.main([*base, "--lr", "0.7", "--momentum", "0.9"], fake_ids, corpus) == 0
    first = records(out)
    assert len(first) == 1
    assert first[0]["bench"] == "outer_sweep" and first[0]["config"]["lr"] == 0.7
    assert [p["outer_step"] for p in first[0]["curve"]] == [2]  # --eval-every 2 over 2 outer steps
    assert {"date", "command", "machine"} <= set(first[0])
    # The same grid plus one new point: only the new point runs.
    assert outer_sweep.main([*base, "--lr", "0.7,1.0", "--momentum", "0.9"], fake_ids, corpus) == 0
    second = records(out)
    assert [r["config"]["lr"] for r in second] == [0.7, 1.0]
    assert second[0] == first[0]
    assert "1 run(s) to do, 1 already" in capsys.readouterr().err
    # Nothing left: no run, and the peer ids (the bench identities) are not even asked for.
    def no_ids(count: int) -> list[str]:
        raise AssertionError("nothing to run")

    assert outer_sweep.main([*base, "--lr", "1.0,0.7", "--momentum", "0.9"], no_ids, corpus) == 0
    assert len(records(out)) == 2


@pytest.mark.parametrize("flags, message", [
    (["--lr", "0.7,abc"], "--lr '0.7,abc': expected comma-separated numbers"),
    (["--momentum", "1.0"], "--momentum '1.0': every value must lie in [0.0, 1.0)"),
    (["--H", "30"], "--steps 1000 is not a multiple of H=30"),
    (["--seeds", "0,x"], "--seeds '0,x': expected comma-separated integers"),
    (["--peers", "1"], "--peers 1: an all-reduce needs at least 2 peers"),
    (["--inner-lr", "0"], "--inner-lr '0': every value must lie in (0.0, 1.0]"),
    (["--overlap-delay", "60"], "--overlap-delay '60': every delay must lie in [0, H=50]"),
    (["--codec", "sparseloco"], "--codec sparseloco has no outer momentum (its decayed error feedback plays that part)"),
    (["--overlap-stand-in", "own"], "--overlap-stand-in applies to overlapped rounds: give --overlap-delay D"),
    (["--overlap-delay", "3", "--overlap-stand-in", "own,mine"], "--overlap-stand-in: expected comma-separated values"),
])
def test_bad_flags_one_error_line(flags: list[str], message: str, tmp_path: Path,
                                  capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "sweep.jsonl"
    assert outer_sweep.main([*flags, "--json-out", str(out)], fake_ids) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("outer_sweep: error: ") and message in err[0], err
    assert not out.exists()


def fake_record(lr: float, momentum: float, seed: int, loss: float, h: int = 50) -> dict:
    config = {"lr": lr, "momentum": momentum, "inner_steps": h, "seed": seed, "steps": 1000, "peers": 4,
              "batch_size": 8, "seq_len": 128, "preset": "tiny", "codec": "int8"}
    return {"bench": "outer_sweep", "ok": True, "config": config, "final_eval_loss": loss, "tokens": 4_096_000,
            "command": "python bench/outer_sweep.py", "wall_seconds": 150.0, "machine": {"loadavg_at_start": [3.0]}}


def test_section_changes_the_default_only_beyond_the_range_overlap() -> None:
    import outer_sweep_results as section

    lr, momentum = section.BASELINE  # the defaults before the sweep: what every row is compared with
    default = [fake_record(lr, momentum, s, loss) for s, loss in enumerate([1.83, 1.87, 1.85])]
    # Mean 0.02 lower, ranges overlap by 1.84 - 1.83 = 0.01: beats it.
    beats = [fake_record(0.65, 0.25, s, loss) for s, loss in enumerate([1.80, 1.84, 1.85])]
    # Mean 0.01 lower, ranges overlap by 1.86 - 1.83 = 0.03: does not.
    close = [fake_record(0.45, 0.55, s, loss) for s, loss in enumerate([1.86, 1.83, 1.84])]
    one_seed = [fake_record(0.35, 0.15, 0, 1.50)]  # lowest of all, but one seed: never a candidate
    default_key = ("int8", 50, lr, momentum)
    decision, key = section.choose(section.group_runs(default + close + one_seed), default_key)
    assert key is None and decision.startswith("**kept**"), decision
    assert "overlapping by 0.0300" in decision and "not candidates: outer lr 0.35, momentum 0.15" in decision
    decision, key = section.choose(section.group_runs(default + close + beats + one_seed), default_key)
    assert key == ("int8", 50, 0.65, 0.25) and decision.startswith("**changed**"), decision
    decision, key = section.choose(section.group_runs(default[:2] + beats), default_key)
    assert key is None and decision.startswith("not decided: the default has 2 seed(s)")
    # Once the default changed to `beats`, a lower mean within the range overlap does not move it
    # again: `closer` is 0.01 lower than `beats` on every seed, their ranges overlap by 0.04.
    closer = [fake_record(0.75, 0.35, s, loss) for s, loss in enumerate([1.79, 1.83, 1.84])]
    current = ("int8", 50, 0.65, 0.25)
    decision, key = section.choose(section.group_runs(default + beats + closer), default_key, current)
    assert key == current and "**kept** there" in decision and "within the 0.0400 overlap" in decision, decision
    assert "lower on each of the 3 seeds (the rule compares ranges, not pairs)" in decision
    # ... and one that beats the current default by the rule does.
    clear = [fake_record(0.85, 0.45, s, loss) for s, loss in enumerate([1.70, 1.72, 1.73])]
    decision, key = section.choose(section.group_runs(default + beats + clear), default_key, current)
    assert key == ("int8", 50, 0.85, 0.45) and decision.startswith("**changed**"), decision
    separate = beats
    default[0]["curve"] = [{"outer_step": 1, "eval_loss": 2.7}, {"outer_step": 20, "eval_loss": 1.83}]
    real = [{"method": "diloco-int8-H50", "seed": 0, "final_eval_loss": 1.832, "run_id": "R", "ok": True,
             "curve": [{"outer_step": 1, "eval_loss": 2.705}, {"outer_step": 20, "eval_loss": 1.832}]}]
    confirm = [{"ok": True, "final_eval_loss": 1.835, "seed": 0, "date": "D", "command": "python bench/convergence.py",
                "machine": {"loadavg_at_start": [2.0]}, "node_sets": ["sync.outer_lr=0.65", "sync.outer_momentum=0.25"]}]
    current = section.node_defaults()
    # The node default on the same seed, from the long benchmark's own record (outer settings in
    # the record, no --set): the challenger's line says how it compares, seed by seed.
    node_default = {"ok": True, "final_eval_loss": 1.840, "seed": 0, "date": "E", "command": "c", "method": "diloco-int8-H50",
                    "machine": {"loadavg_at_start": [1.0]}, "outer_lr": current[0], "outer_momentum": current[1]}
    lines = section.results_section(default + separate, real, {"ddp": {"mean": 1.69}}, [node_default] + confirm)
    text = "\n".join(lines)
    assert "| 0 | 1.8300 | 1.8320 | -0.0020 | 0.0050 (2) |" in text  # emulator vs real node, seed 0
    assert "| int8-H50 | 0.65 | 0.25 | 0, 1, 2 | 1.8300 | 1.8000 – 1.8500 | -1.1 % | +8.3 % |" in text
    assert f"outer lr {current[0]:g}, momentum {current[1]:g} (node default): seeds 0: 1.8400" in text
    assert ("outer lr 0.65, momentum 0.25: seeds 0: 1.8350 (mean 1.8350, +8.6 % vs ddp; load average 2.0–2.0 at "
            "the starts); emulator 1.8000; the old default on the real node 1.8320; against the node default on "
            "the same seeds: -0.0050 (1 of 1 lower, mean -0.0050).") in text
    assert f"node/config_sections.py has outer_lr {current[0]:g}, outer_momentum {current[1]:g}" in text


def study_record(seed: int, loss: float, **config) -> dict:
    record = fake_record(1.0, 0.5, seed, loss)
    record["config"].update(config)
    return record


def test_gap_section_compares_each_row_with_single_at_its_own_lr_and_at_the_best() -> None:
    import inner_lr_results

    lr, momentum = outer_sweep_results_defaults()
    records = [study_record(s, loss, method="single", codec="fp32", lr=1.0, momentum=0.0, inner_lr=ilr)
               for ilr, losses in ((1e-3, (1.70, 1.72)), (2e-3, (1.66, 1.68))) for s, loss in enumerate(losses)]
    records += [study_record(s, loss, inner_lr=2e-3, lr=lr, momentum=momentum) for s, loss in enumerate((1.78, 1.80))]
    records += [study_record(s, loss, lr=lr, momentum=momentum) for s, loss in enumerate((1.81, 1.83))]  # node default
    records += [study_record(0, 1.90, lr=0.7, momentum=0.9)]  # the outer sweep's: not this section's row
    text = "\n".join(inner_lr_results.results_section(records))
    assert "| tiny | single | 0.001 | – | 0, 1 | 1.7100 | 1.7000 – 1.7200 | – | – |" in text
    # 1.79 / 1.67 − 1 = +7.2 % against single at 2e-3, which is also the best single (1.67 < 1.71).
    assert f"| tiny | diloco int8-H50 | 0.002 | {lr:g} / {momentum:g} | 0, 1 | 1.7900 | 1.7800 – 1.8000 | +7.2 % | +7.2 % (lr 0.002) |" in text
    assert f"| tiny | diloco int8-H50 (node default) | 0.001 | {lr:g} / {momentum:g} | 0, 1 | 1.8200 |" in text
    assert "+6.4 % | +9.0 % (lr 0.002) |" in text  # 1.82 / 1.71 and 1.82 / 1.67
    assert "0.7 / 0.9" not in text
    assert inner_lr_results.floor_text(records) is None  # no H = 1 run: nothing to say about the floor
    records += [study_record(s, loss, codec="fp32", inner_steps=1, lr=1.0, momentum=0.0) for s, loss in enumerate((1.80, 1.84))]
    assert inner_lr_results.floor_text(records).startswith(
        "profile: averaging after every inner step in fp32 (H = 1, emulator) ends +6.4 % from `single` at the same "
        "inner lr on seeds 0, 1,")  # 1.82 / 1.71


def outer_sweep_results_defaults() -> tuple[float, float]:
    import outer_sweep_results

    return outer_sweep_results.node_defaults()


def test_overlap_delay_section_gives_the_penalty_per_seed_against_the_blocking_run() -> None:
    import overlap_delay_results

    lr, momentum = outer_sweep_results_defaults()
    common = {"inner_steps": 20, "steps": 400, "lr": lr, "momentum": momentum}
    records = [study_record(s, loss, **common) for s, loss in enumerate((2.00, 2.10))]
    records += [study_record(s, loss, overlap_delay=10, **common) for s, loss in enumerate((2.02, 2.1105))]
    other = {**common, "lr": 0.3}
    records += [study_record(0, 2.20, **other), study_record(0, 2.09, overlap_delay=10, **other)]
    records += [study_record(s, 2.5, **{**common, "inner_steps": 50}) for s in range(2)]  # blocking only: no table
    text = "\n".join(overlap_delay_results.results_section(records))
    assert f"| {lr:g} / {momentum:g} (node default) | blocking | – | – | 0, 1 | 2.0500 | – | – | – |" in text
    delayed = "own end point (`delayed`)"
    assert (f"| {lr:g} / {momentum:g} (node default) | 10 | 0.50 | {delayed} | 0, 1 | 2.0652 | +0.75 % | "
            "+0.50 … +1.00 % | +0.75 % |") in text
    # Another outer setting: its penalty against its own blocking run (−5 %) and the default's (+4.5 %).
    assert f"| 0.3 / {momentum:g} | 10 | 0.50 | {delayed} | 0 | 2.0900 | -5.00 % | -5.00 … -5.00 % | +4.50 % |" in text
    assert f"| 0.3 / {momentum:g} | blocking | – | – | 0 | 2.2000 | – | – | +10.00 % |" in text
    assert "H = 50" not in text
    records += [study_record(s, loss, overlap_delay=5, **common) for s, loss in enumerate((2.01, 2.11))]
    assert overlap_delay_results.profile_text(records, 20, 0.007) == (
        "profile: on the emulator (section 5b) staleness alone keeps the penalty within 0.7 % only while the "
        "round's result lands within 5 of the 20 inner steps (+0.75 % at 10)")
    assert overlap_delay_results.profile_text(records, 20, 0.001).endswith("at none of the delays run (+0.49 % at 5)")
    assert overlap_delay_results.profile_text(records, 50, 0.01) is None  # no delayed run at H = 50
    # A stand-in run gets its own row after delayed's at its D, and stays out of the profile.
    records += [study_record(s, loss, overlap_delay=10, overlap_stand_in="own", **common)
                for s, loss in enumerate((2.03, 2.142))]
    text = "\n".join(overlap_delay_results.results_section(records))
    eager_row = (f"| {lr:g} / {momentum:g} (node default) | 10 | 0.50 | step with own Δ (`eager`) | 0, 1 | 2.0860 | "
                 "+1.75 % | +1.50 … +2.00 % | +1.75 % |")
    assert eager_row in text and text.index(delayed, text.index("| 10 | 0.50 |")) < text.index(eager_row)
    assert overlap_delay_results.profile_text(records, 20, 0.007).endswith("(+0.75 % at 10)")
