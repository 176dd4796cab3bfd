"""The scale model (planner/scale.py) against hand-computed figures: a job read from its record, what TP and PP
can split, communication, memory and step time, and the tables a user reads, rendered whole."""

from __future__ import annotations

import math

import pytest

from modelwright.planner.memory import MIB
from modelwright.planner.prices import HOW_TO_PRICE, PRICE_SOURCE
from modelwright.planner.scale import (
    FABRICS,
    LATENCY_SOURCE,
    OVERLAP_SOURCE,
    Assumptions,
    Compute,
    JobSpec,
    StepPrediction,
    cannot_split,
    collective_units,
    comm_bytes_per_step,
    communication_time,
    compute_per_step,
    markdown_tables,
    max_params,
    measured_optimizer_bytes,
    model_shape,
    predict_memory_mib,
    predict_step,
    scaling_rows,
    spec_from_record,
    time_row,
)

#: α inside a node: NVLink's 10 µs over a ring of 8's 14 steps.
ALPHA = 10e-6 / 14

# --- a job from its record ---------------------------------------------------------------------------------

#: A saved-tensor profile as the schema-2 studies wrote it (profile.json): three blocks, units with and without
#: a width.
PROFILE = {
    "batch_size": 4,
    "segments": {"stage": [{"input_bytes": 99_999}],
                 "block": [{"input_bytes": 4096}, {"input_bytes": 16_384}, {"input_bytes": 8192}]},
    "units": [{"name": "conv1", "width": 64}, {"name": "bn1", "width": None}, {"name": "relu"},
              {"name": "layer1.conv", "width": 32}, {"name": "fc", "width": 128}],
}


def test_the_shape_a_profile_gives_tp_and_pp():
    # 3 blocks; the narrowest layer of widths 64, 32, 128 (units without one skipped); the largest block input,
    # 16,384 B for a batch of 4, is 4,096 B a sample (the stage's larger input is no block boundary)
    assert model_shape(PROFILE) == {"num_layers": 3, "min_width": 32, "boundary_bytes_per_sample": 4096.0}
    # no blocks and no widths: nothing TP or PP could split, and no boundary
    assert model_shape({"batch_size": 2, "segments": {"stage": []}, "units": [{"name": "relu", "width": None}]}) == {
        "num_layers": None, "min_width": None, "boundary_bytes_per_sample": 0.0}
    assert model_shape(None) == {} and model_shape({}) == {}


def _record(**techniques) -> dict:
    """A full record: Adafactor (state measured), bf16-mixed, 4 micro-batches of 64, a profile."""
    return {
        "run_id": "r7", "hardware": {"device_name": "NVIDIA H100 80GB HBM3"},
        "techniques": {"model_name": "vit_tiny", "precision": "bf16-mixed", "optimizer": "adafactor",
                       "micro_batch_size": 64, "accumulate_grad_batches": 4, "trainable_parameters": 1_000_000,
                       **techniques},
        "memory": {"model_parameters": 2_000_000,
                   "anatomy_mib": {"activations": 128.0, "temporaries": 24.0, "optimizer_state": 3.0}},
        "timing": {"step_time_median_ms": 250.0},
        "profile": PROFILE,
    }


def test_a_spec_from_a_full_record_takes_every_figure_it_holds():
    expected = JobSpec(
        num_params=2_000_000, precision="bf16-mixed", optimizer="adafactor", micro_batch_size=64,
        accumulate_grad_batches=4,
        activation_bytes_per_sample=2 * MIB,  # 128 MiB over 64 samples
        temporaries_bytes=24 * MIB,
        step_time_ms=250.0, step_time_source="measured, run r7 on NVIDIA H100 80GB HBM3",
        num_layers=3, min_width=32, boundary_bytes_per_sample=4096.0,  # the profile's (test above)
        model_name="vit_tiny",
        optimizer_bytes=3.145728,  # 3 MiB of state over the 1,000,000 trainable parameters
    )
    assert spec_from_record(_record()) == expected
    # a shape given (the network's) wins over the record's profile
    shape = {"num_layers": 12, "min_width": 192, "boundary_bytes_per_sample": 100.0}
    assert spec_from_record(_record(), shape) == JobSpec(**{**vars(expected), **shape})


def _minimal_record(optimizer: str = "sgd", **config) -> dict:
    """Only the keys a spec needs: no run id, hardware, model name, accumulation, temporaries or profile."""
    return {"techniques": {"micro_batch_size": 8, "optimizer": optimizer, "precision": "32-true"},
            "memory": {"model_parameters": 1000, "anatomy_mib": {"activations": 4.0}},
            "timing": {"step_time_median_ms": 10.0}, "config": {"model": config}}


def test_a_spec_from_a_minimal_record_falls_back_to_the_defaults():
    assert spec_from_record(_minimal_record(momentum=0.9)) == JobSpec(
        num_params=1000, precision="32-true", optimizer="sgd", micro_batch_size=8, accumulate_grad_batches=1,
        activation_bytes_per_sample=MIB / 2,  # 4 MiB over 8 samples
        temporaries_bytes=0.0, step_time_ms=10.0, step_time_source="measured, run ? on ?", model_name="")
    # a null accumulation (or model name) in the record reads as none
    record = _minimal_record(momentum=0.9)
    record["techniques"].update(accumulate_grad_batches=None, model_name=None)
    spec = spec_from_record(record)
    assert (spec.accumulate_grad_batches, spec.model_name) == (1, "")


@pytest.mark.parametrize(("optimizer", "momentum", "planned"), [
    ("sgd", 0, "sgd-nomomentum"), ("sgd", 0.0, "sgd-nomomentum"),  # no momentum buffer: no state at all
    ("sgd", 0.9, "sgd"), ("sgd", 1.0, "sgd"), ("sgd", None, "sgd"),  # None: the config does not say
    ("adamw", 0, "adamw"),  # momentum 0 is SGD's; AdamW keeps its two moments
])
def test_sgd_without_momentum_is_planned_without_state(optimizer, momentum, planned):
    record = _minimal_record(optimizer) if momentum is None else _minimal_record(optimizer, momentum=momentum)
    assert spec_from_record(record).optimizer == planned


def test_adafactors_state_is_read_from_the_record_as_measured():
    record = _record()
    assert measured_optimizer_bytes(record, "adamw") is None  # 2 words a parameter: nothing to measure
    # 3 MiB over the trainable parameters (1,000,000), not all 2,000,000
    assert measured_optimizer_bytes(record, "adafactor") == 3 * 2**20 / 1_000_000
    del record["techniques"]["trainable_parameters"]
    assert measured_optimizer_bytes(record, "adafactor") == 3 * 2**20 / 2_000_000  # all are trained
    del record["memory"]["anatomy_mib"]["optimizer_state"]
    with pytest.raises(KeyError, match=r"record is missing 'memory.anatomy_mib.optimizer_state' \(adafactor's state\)"):
        measured_optimizer_bytes(record, "adafactor")


def test_a_record_without_parameter_counts_names_the_parameter_key():
    record = _record()
    del record["techniques"]["trainable_parameters"]
    del record["memory"]["model_parameters"]
    missing = r"record is missing 'memory.model_parameters' \(adafactor's state per parameter\)"
    with pytest.raises(KeyError, match=missing):
        measured_optimizer_bytes(record, "adafactor")


# --- what TP and PP can split ------------------------------------------------------------------------------


def test_tp_splits_a_layer_only_into_whole_shares_of_8_channels_or_more():
    a = Assumptions()
    unknown = JobSpec(num_params=10)
    assert cannot_split(unknown, "tp", 1, a) is None  # one rank splits nothing
    assert cannot_split(unknown, "tp", 2, a) == "TP: the model's layer widths are unknown"
    narrow = JobSpec(num_params=10, min_width=32)
    assert cannot_split(narrow, "tp", 2, a) is None  # 16 channels each
    assert cannot_split(narrow, "tp", 4, a) is None  # 8 each: the least allowed
    assert cannot_split(narrow, "tp", 3, a) == "TP: the narrowest layer has 32 channels; 3 ranks leave < 8 each"
    assert cannot_split(narrow, "tp", 8, a) == "TP: the narrowest layer has 32 channels; 8 ranks leave < 8 each"


def test_pp_needs_a_block_per_stage():
    a = Assumptions()
    assert cannot_split(JobSpec(num_params=10), "pp", 1, a) is None
    assert cannot_split(JobSpec(num_params=10), "pp", 2, a) == "PP: 2 stages but unknown blocks to cut between"
    four = JobSpec(num_params=10, num_layers=4)
    assert cannot_split(four, "pp", 4, a) is None  # a block per stage
    assert cannot_split(four, "pp", 5, a) == "PP: 5 stages but 4 blocks to cut between"


# --- communication, compute and memory ---------------------------------------------------------------------

#: 100 M fp32 parameters (400 MB of gradients), 4 micro-batches of one sample, 5 blocks, 1 MB at each boundary.
BIG = JobSpec(num_params=100_000_000, accumulate_grad_batches=4, num_layers=5, boundary_bytes_per_sample=1e6)
ONE_GB = Assumptions(intra_node_gb_per_s=1.0)


def test_communication_time_by_hand():
    # DP at 2 ranks: 2 · 1/2 · 400 MB = 400 MB at 1 GB/s (10^9 B/s, not 2^30) = 0.4 s, plus 16 buckets of 25 MiB
    # (400 MB / 26,214,400 B = 15.3) each paying a ring of 2's 2 steps of α
    dp = communication_time(BIG, "dp", 2, ONE_GB, compute_s=1.2)
    assert dp.total_s == pytest.approx(0.4 + 16 * 2 * ALPHA, rel=1e-12)
    # backward of the last micro-batch: 2/3 · 1.2 s / 4 = 0.2 s hides everything but the last bucket and the
    # 0.2 s the rest overruns it by
    assert dp.exposed_s == pytest.approx(dp.total_s - 0.2)
    # TP: 4 micro-batches · 5 blocks · 4 all-reduces · 2 · 1/2 · 1 MB = 80 MB, 0.08 s, plus 80 collectives of 2 α;
    # between two layers, none of it hides, however long the step
    tp = communication_time(BIG, "tp", 2, ONE_GB, compute_s=100.0)
    assert tp.total_s == pytest.approx(0.08 + 80 * 2 * ALPHA) and tp.exposed_s == tp.total_s
    # PP: 1 MB forward and its gradient back per sample, 4 samples: 8 MB, 8 ms, plus one α per message each way
    # for m = 4 × 2 stages = 8 micro-batches; the step waits for all of it
    pp = communication_time(BIG, "pp", 2, ONE_GB, compute_s=100.0)
    assert pp.total_s == pytest.approx(0.008 + 2 * 8 * ALPHA) and pp.exposed_s == pp.total_s


def test_a_model_of_unknown_blocks_counts_as_one_block():
    unknown = JobSpec(num_params=1000, accumulate_grad_batches=2, boundary_bytes_per_sample=100.0)
    assert collective_units(unknown, "fsdp") == 3 * 1 * 2  # 2 gathers and a scatter, 1 block, 2 micro-batches
    # TP: 2 micro-batches · 1 block · 4 all-reduces · 2 · 3/4 of 100 B
    assert comm_bytes_per_step(unknown, "tp", 4) == pytest.approx(2 * 1 * 4 * 2 * 0.75 * 100)


def test_tp_splits_each_layers_compute_on_the_measured_batch():
    spec = JobSpec(num_params=10, micro_batch_size=8, accumulate_grad_batches=4, step_time_ms=1000.0)
    # a quarter of the 1 s step on each of 4 ranks, all on the same 8 × 4 samples
    assert compute_per_step(spec, "tp", 4, Assumptions()) == Compute(0.25, 32, 0.0)


#: 2^20 fp32 AdamW parameters (4 + 4 + 8 MiB), 8 samples of 1 MiB activations each, 2 MiB of temporaries.
SMALL = JobSpec(num_params=2**20, micro_batch_size=8, activation_bytes_per_sample=MIB, temporaries_bytes=2 * MIB,
                step_time_ms=1000.0)


def test_memory_per_rank_of_every_strategy_by_hand():
    spec = JobSpec(**{**vars(SMALL), "accumulate_grad_batches": 3})
    expected = {  # parameters, gradients, optimizer state (MiB) sharded as ZeRO does; activations; temporaries 2
        "dp": (4, 4, 8, 8), "zero1": (4, 4, 8 / 4, 8), "zero2": (4, 4 / 4, 8 / 4, 8),
        "fsdp": (1, 1, 2, 8), "tp": (1, 1, 2, 8 / 4),
        # 8 × 3 samples in m = 4 × 4 = 16 micro-batches of 1.5 MiB; 1F1B holds min(4, 16) of them on the first
        # stage, which holds a quarter of the model: 1.5 · 4 / 4
        "pp": (1, 1, 2, 1.5),
    }
    for strategy, (parameters, gradients, optimizer, activations) in expected.items():
        memory = predict_memory_mib(spec, strategy, 4)
        assert memory == pytest.approx({
            "parameters": parameters, "gradients": gradients, "optimizer_state": optimizer,
            "activations": activations, "temporaries": 2.0,
            "total": parameters + gradients + optimizer + activations + 2.0}), strategy
    # m = 8: micro-batches of 3 MiB, min(4, 8) in flight; m = 2: of 12 MiB, only 2 in flight
    assert predict_memory_mib(spec, "pp", 4, Assumptions(pp_microbatches=8))["activations"] == pytest.approx(3.0)
    assert predict_step(spec, "pp", 4, Assumptions(pp_microbatches=2)).memory_mib["activations"] == pytest.approx(
        12 * 2 / 4)


def test_a_job_fits_a_device_of_exactly_its_size():
    # DP holds 4 + 4 + 8 + 8 + 2 = 26 MiB on each rank
    assert predict_step(SMALL, "dp", 1, Assumptions(device_memory_gib=26 / 1024)).fits is True
    assert predict_step(SMALL, "dp", 1, Assumptions(device_memory_gib=25.99 / 1024)).fits is False


def test_a_step_of_no_measured_time_has_no_finite_throughput():
    assert predict_step(JobSpec(num_params=10), "dp", 1).samples_per_s == math.inf


def test_the_largest_model_that_fits_by_hand():
    a = Assumptions(device_memory_gib=1.0)
    # 1,024 MiB less 8 MiB of activations and 2 of temporaries, 16 B a parameter: 1,014 · 2^20 / 16
    assert max_params(SMALL, "dp", 1, a) == 1014 * 2**16
    # ZeRO-1 at 4 ranks: 4 + 4 + 8/4 = 10 B a parameter
    assert max_params(SMALL, "zero1", 4, a) == 1014 * 2**20 // 10
    # PP at 4 stages of m = 2 micro-batches of 4 MiB, 2 in flight: 2 MiB of activations a stage; 16/4 B a parameter
    assert max_params(SMALL, "pp", 4, Assumptions(device_memory_gib=1.0, pp_microbatches=2)) == 1020 * 2**18
    # 5.12 MiB of device: the activations alone do not fit
    assert max_params(SMALL, "dp", 1, Assumptions(device_memory_gib=0.005)) == 0


# --- the tables --------------------------------------------------------------------------------------------


def test_a_time_row_marks_every_estimate():
    pipeline = StepPrediction(strategy="pp", devices=2, memory_mib={}, comm_bytes=3 * MIB, comm_s=0.002,
                              comm_exposed_s=0.001, bubble_of_compute=0.25, bubble_of_step=0.2, step_s=0.5,
                              samples_per_step=1, samples_per_s=1.0, fits=True)
    # 7,199 samples at 1 a second: 7,199 s = 2.0 h less a second, on 2 devices at $18/h = $71.99
    assert time_row(pipeline, epochs=1, dataset_size=7199, price_per_hour=18.0) == [
        "PP", 2, "3.00", "2 ms, 1 ms exposed (est.)", "25%", "20%", "500 ms (est.)", "1.00 (est.)",
        "120 min (est.)", "$71.99 (est.)"]
    ddp = StepPrediction(**{**vars(pipeline), "strategy": "dp"})
    assert time_row(ddp, epochs=1, dataset_size=7199, price_per_hour=None) == [
        "DP (DDP)", 2, "3.00", "2 ms, 1 ms exposed (est.)", "–", "–", "500 ms (est.)", "1.00 (est.)",
        "120 min (est.)", "–"]


def test_rows_say_what_does_not_fit_and_why_a_strategy_cannot_split():
    spec = JobSpec(**{**vars(SMALL), "num_layers": 3, "min_width": 32})
    # 20 MiB a device. DP holds 26 MiB everywhere; ZeRO-1 4 + 4 + 8/N + 8 + 2: 22, 20.7, 20 (fits exactly);
    # ZeRO-2 4 + 12/N + 10: 20, 18, 17; FSDP 16/N + 10; TP 16/N + 8/N + 2; PP 16/N + at most 1 + 2
    memory_rows, time_rows = scaling_rows(spec, (2, 3, 4), Assumptions(device_memory_gib=20 / 1024), epochs=1,
                                          dataset_size=1000, priced=False)
    tp_3 = "TP: the narrowest layer has 32 channels; 3 ranks leave < 8 each"  # 32 channels split 3 ways
    pp_4 = "PP: 4 stages but 3 blocks to cut between"
    assert [(row[0], row[1], row[-1]) for row in memory_rows] == [
        ("DP (DDP)", 2, "no"), ("DP (DDP)", 3, "no"), ("DP (DDP)", 4, "no"),
        ("ZeRO-1", 2, "no"), ("ZeRO-1", 3, "no"), ("ZeRO-1", 4, "yes"),
        ("ZeRO-2", 2, "yes"), ("ZeRO-2", 3, "yes"), ("ZeRO-2", 4, "yes"),
        ("ZeRO-3 / FSDP", 2, "yes"), ("ZeRO-3 / FSDP", 3, "yes"), ("ZeRO-3 / FSDP", 4, "yes"),
        ("TP", 2, "yes"), ("TP", 3, "–"), ("TP", 4, "yes"),  # 8 channels each at 4 ranks: split
        ("PP", 2, "yes"), ("PP", 3, "yes"), ("PP", 4, "–")]
    assert memory_rows[13] == ["TP", 3, tp_3, "–", "–", "–", "–", "–"]
    assert time_rows[13] == ["TP", 3, tp_3, "–", "–", "–", "–", "–", "–", "–"]
    assert time_rows[17] == ["PP", 4, pp_4, "–", "–", "–", "–", "–", "–", "–"]
    assert all(row[-1] == "–" for row in time_rows), "a job not priced has no cost"


def test_the_whole_scaling_report_of_a_small_job():
    """Every line of the tables of a 2^20-parameter job at 1 and 4 ranks, with the default 100 epochs of 50,000
    samples, H100 fabric, price and memory. TP at 4 ranks would leave 16 / 4 = 4 channels: refused."""
    spec = JobSpec(**{**vars(SMALL), "num_layers": 4, "min_width": 16, "boundary_bytes_per_sample": MIB / 8})
    # At 1 rank every strategy runs the measured step: 1 s for 8 samples; 5,000,000 samples take 625,000 s =
    # 7.23 days = 173.6 h at $2.50/h = $434. PP's 8 samples in m = 4 micro-batches of 2 MiB hold 2 MiB.
    one_rank = ("| 1 | 0 | 0 ms, 0 ms exposed (est.) | – | – | 1 s (est.) | 8.00 (est.) | 7.23 days (est.) "
                "| $434 (est.) |")
    # At 4 ranks (450 GB/s, α = 0.714 µs): DP, ZeRO-1 and ZeRO-2 (one micro-batch) send 3/4 · 8 MiB = 6 MiB,
    # 14.0 µs, in one bucket paying 6 α = 4.3 µs: 18.3 µs, all exposed; 32 samples in 1.0000183 s = 32.0/s,
    # 156,253 s = 43.4 h, × 4 devices × $2.50 = $434.
    # FSDP: 3/4 · (2 · 4 + 4) MiB = 9 MiB, 21.0 µs, in 3 × 4 blocks = 12 collectives of 6 α = 51.4 µs: 72.4 µs,
    # of which the last block's twelfth, 6.03 µs, is exposed.
    # PP: 2 · 1 MiB boundary = 2 MiB, 4.7 µs, plus 2 · 16 micro-batches · α = 22.9 µs: 27.5 µs, all exposed;
    # compute 1 s / 4 · (1 + 3/16) = 296.9 ms for 8 samples = 26.9/s; 185,564 s = 2.15 days; × 4 × $2.50 / 3600 =
    # $515. Bubble 3/16 = 19% of the ideal compute, 3/19 = 16% of the step.
    ring = ("| 6.00 | 0.0183 ms, 0.0183 ms exposed (est.) | – | – | 1 s (est.) | 32.0 (est.) | 43.4 h (est.) "
            "| $434 (est.) |")
    dashes = " | – | – | – | – | –"
    tp_4 = "| TP | 4 | TP: the narrowest layer has 16 channels; 4 ranks leave < 8 each" + dashes
    # The largest model: 80 GiB = 81,920 MiB less 8 + 2 MiB, over 16 B a parameter (10, 7 and 4 at 4 ranks of
    # ZeRO-1, ZeRO-2, FSDP): 81,910 · 2^20 / 16 = 5.37 B; / 10 = 8.59 B; / 7 = 12.3 B; / 4 = 21.5 B.
    expected = "\n".join([
        "- model: unnamed, 1,048,576 parameters; 32-true + adamw: 4 + 4 + 8 = 16 B/parameter (fp32 weights, grads "
        "and optimizer state)",
        "- measured: per-rank batch 8 × 1; activations 1.00 MiB/sample; step 1,000 ms (assumed)",
        f"- assumed: network: {FABRICS['H100 SXM'].source}; 8 per node",
        f"- assumed: latency: {LATENCY_SOURCE}",
        f"- assumed: overlap: 100% of backward; {OVERLAP_SOURCE}",
        f"- assumed: price: H100 SXM $2.50–5.00/h, low end; {PRICE_SOURCE}",
        "- estimates: every time, throughput and cost below is an estimate from the figures above",
        "",
        "### Per-device memory (MiB)",
        "",
        "| strategy | N | parameters | gradients | optimizer | activations | total | fits |",
        "|:--|--:|--:|--:|--:|--:|--:|--:|",
        "| DP (DDP) | 1 | 4.00 | 4.00 | 8.00 | 8.00 | 26.0 | yes |",
        "| DP (DDP) | 4 | 4.00 | 4.00 | 8.00 | 8.00 | 26.0 | yes |",
        "| ZeRO-1 | 1 | 4.00 | 4.00 | 8.00 | 8.00 | 26.0 | yes |",
        "| ZeRO-1 | 4 | 4.00 | 4.00 | 2.00 | 8.00 | 20.0 | yes |",
        "| ZeRO-2 | 1 | 4.00 | 4.00 | 8.00 | 8.00 | 26.0 | yes |",
        "| ZeRO-2 | 4 | 4.00 | 1.00 | 2.00 | 8.00 | 17.0 | yes |",
        "| ZeRO-3 / FSDP | 1 | 4.00 | 4.00 | 8.00 | 8.00 | 26.0 | yes |",
        "| ZeRO-3 / FSDP | 4 | 1.00 | 1.00 | 2.00 | 8.00 | 14.0 | yes |",
        "| TP | 1 | 4.00 | 4.00 | 8.00 | 8.00 | 26.0 | yes |",
        tp_4 + " |",
        "| PP | 1 | 4.00 | 4.00 | 8.00 | 2.00 | 20.0 | yes |",
        "| PP | 4 | 1.00 | 1.00 | 2.00 | 0.500 | 6.50 | yes |",  # 1 + 1 + 2 + 0.5 + 2
        "",
        "### Communication, time and cost (100 epochs of 50,000 samples)",
        "",
        "| strategy | N | comm/step (MiB) | comm time, exposed | bubble ÷ ideal compute, (p-1)/m "
        "| bubble ÷ step, (p-1)/(m+p-1) | step time | samples/s | train time | cost |",
        "|:--|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
        "| DP (DDP) " + one_rank,
        "| DP (DDP) | 4 " + ring,
        "| ZeRO-1 " + one_rank,
        "| ZeRO-1 | 4 " + ring,
        "| ZeRO-2 " + one_rank,
        "| ZeRO-2 | 4 " + ring,
        "| ZeRO-3 / FSDP " + one_rank,
        "| ZeRO-3 / FSDP | 4 | 9.00 | 0.0724 ms, 0.00603 ms exposed (est.) | – | – | 1 s (est.) | 32.0 (est.) "
        "| 43.4 h (est.) | $434 (est.) |",
        "| TP " + one_rank,
        tp_4 + " | – | – |",
        "| PP " + one_rank.replace("| – | – |", "| 0% | 0% |"),
        "| PP | 4 | 2.00 | 0.0275 ms, 0.0275 ms exposed (est.) | 19% | 16% | 297 ms (est.) | 26.9 (est.) "
        "| 2.15 days (est.) | $515 (est.) |",
        "",
        "### Largest parameter count that fits 80 GiB per device",
        "",
        "| strategy | N = 1 | N = 4 |",
        "|:--|--:|--:|",
        "| DP (DDP) | 5.37 B | 5.37 B |",
        "| ZeRO-1 | 5.37 B | 8.59 B |",
        "| ZeRO-2 | 5.37 B | 12.3 B |",
        "| ZeRO-3 / FSDP | 5.37 B | 21.5 B |",
        "",
    ])
    assert markdown_tables(spec, (1, 4)) == expected
    # not priced: one line says how to price it, and no row has a cost
    unpriced = markdown_tables(spec, (1, 4), priced=False).splitlines()
    assert unpriced[6] == f"- cost: {HOW_TO_PRICE}"
    assert [line.rsplit("|", 2)[1] for line in unpriced if line.startswith("| ") and "(est.)" in line] == [" – "] * 11
