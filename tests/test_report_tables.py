"""The report's tables rendered whole from hand-built studies: every column, every kind of row, and the notes
under them. Each expected cell is worked out by hand in the comments from the records written here."""

from __future__ import annotations

import dataclasses

import pytest

from modelwright import planner, study_rows
from modelwright.planner.prices import CPU_PRICE_SOURCE, PRICE_SOURCE, MachinePrice
from modelwright.report import tables
from modelwright.study_rows import BudgetRow
from test_report import epoch_record, rec

#: Two vCPU at $0.0408 each: what every CPU row below costs per second.
CPU_USD_PER_S = 2 * 0.0408 / 3600
MARKS = {"commit c0ffee, definitions 3": "a", "commit deadbeef, definitions 3": "b"}


def ended(record: dict, activations: float) -> dict:
    """``record`` with ``activations`` MiB of activations still held after its step."""
    record["memory"]["anatomy_end_mib"] = {"activations": activations}
    return record


def mixed_study() -> list[dict]:
    """Every kind of row: a baseline of 3 repeats; amp, 2 repeats of two commits; a compiled run (no peak on a
    CPU) with the system allocator; a run whose loss saw fewer samples; a run on a GPU with no price; a failed
    and an out-of-memory run. Epochs: the baseline's (72 s, 32 steps, 8 s of 2 validations), amp's (36 s) and
    compile's, a record without its steps or validations."""
    records = [rec("baseline", 2000, 700, 0), ended(rec("baseline", 2100, 700, 1), 0.5),
               rec("baseline", 2200, 700, 2)]
    records += [ended(rec("amp", 1400, 350, 0, index=1, precision="bf16-mixed"), 1.0),
                rec("amp", 1600, 350, 1, index=1, precision="bf16-mixed", commit="deadbeef")]
    compiled = ended(rec("compile", 2100, 700, 0, index=2, compile_=True), 5.0)
    compiled["config"] = {"cpu_malloc": "system"}
    records += [compiled, ended(rec("short", 1050, 690, 0, index=3, loss=(2.4, 2.3, 2.2)), 2.0)]
    gpu = rec("gpu", 50, 400, 0, index=4)
    gpu["hardware"] = {"accelerator": "cuda", "device_name": "Example GPU"}
    gpu["memory"]["anatomy_mib"]["communication_buffers"] = 12.0
    records.append(gpu)
    for index, status in ((5, "failed"), (6, "oom")):
        record = rec(status, 2000, 700, 0, index=index)
        record.update(status=status, error=f"it went {status}")
        records.append(record)
    bare = epoch_record("compile", 50.0, 32, 0.0, index=2)
    for key in ("epoch_steps", "epoch_validation_s", "epoch_validations"):
        del bare["timing"][key]
    return records + [epoch_record("baseline", 72.0, 32, 8.0), epoch_record("amp", 36.0, 32, 4.0, index=1), bare]


@pytest.fixture(scope="module")
def mixed_rows() -> list[study_rows.Row]:
    rows = study_rows.build_rows(mixed_study())
    assert [(row.name, row.status) for row in rows] == [
        ("baseline", "ok"), ("amp", "ok"), ("compile", "ok"), ("short", "ok"), ("gpu", "ok"),
        ("failed", "failed"), ("oom", "oom")]
    return rows


def test_main_table_shows_every_finished_run_and_every_column(mixed_rows):
    """samples/s: 128,000 / the median step; cost per 1,000 samples: 1,000 / samples/s × $0.0816/h; per epoch:
    its seconds × $0.0816/h. Letters: each repeat's commit. Failed and out-of-memory runs have no row here."""
    # baseline: 128e3 / 2100 = 61.0 samples/s, 16.4 s per 1,000 samples = $0.00037; 72 s = $0.0016
    # amp: 1500 / 2100 = 0.71×, repeats paired 1400/2000 and 1600/2100; 85.7 samples/s: $0.00026; 36 s: $0.00082
    # compile: no peak (eager code only); 50 s: $0.0011. short: 690 / 700 = 0.99×, its loss saw 3 × 128 samples,
    # not the baseline's 4 × 128. gpu: "Example GPU" has no listed price.
    assert tables.main_table(mixed_rows, MARKS) == "\n".join([
        "| run | setup | peak MiB | memory vs base | step ms (median of repeats) | repeat medians min–max (n) "
        "| time vs base | 95% interval, paired repeats | verdict | samples/s | MFU | time per epoch "
        "| cost per epoch (est.) | cost per 1,000 samples (est.) | train loss, last 3 steps |",
        "|:--|:--|--:|--:|--:|--:|--:|:--|:--|--:|--:|--:|--:|--:|--:|",
        "| baseline [a] | 32-true, 128, AdamW for-loop | 700 | 1.0× | 2,100 | 2,000–2,200 (3) | 1.0× | reference "
        "| no measurable change | 61.0 | 50% | 72 s | $0.0016 | $0.00037 | 2.20 |",
        "| amp [a,b] | bf16-mixed, 128, AdamW for-loop | 350 | 0.50× | 1,500 | 1,400–1,600 (2) | 0.71× "
        "| 0.700–0.762× (2 pairs) | faster | 85.7 | 50% | 36 s | $0.00082 | $0.00026 | 2.20 |",
        "| compile [a] | 32-true, 128, compile, system malloc, AdamW for-loop | not measured | – | 2,100 "
        "| – (1 repeat) | 1.0× | – (1 repeat) | no verdict: 1 repeat | 61.0 | 50% | 50 s | $0.0011 | $0.00037 "
        "| 2.20 |",
        "| short [a] | 32-true, 128, AdamW for-loop | 690 | 0.99× | 1,050 | – (1 repeat) | 0.50× | – (1 repeat) "
        "| no verdict: 1 repeat | 122 | 50% | not measured | not measured | $0.00019 | – |",
        "| gpu [a] | 32-true, 128, AdamW for-loop | 400 | 0.57× | 50.0 | – (1 repeat) | 0.024× | – (1 repeat) "
        "| no verdict: 1 repeat | 2,560 | 50% | not measured | – | – | 2.20 |"])


def test_price_notes_name_each_price_used_and_the_devices_without_one(mixed_rows):
    assert tables.price_notes(mixed_rows) == [
        f"Cost (estimate): 2 vCPU at $0.0816/h; {CPU_PRICE_SOURCE}.",
        "Cost: – where the device has no listed price (GPUs priced: A100, H100, H200)."]
    priced = [row for row in mixed_rows if row.name != "gpu"]
    assert tables.price_notes(priced) == [f"Cost (estimate): 2 vCPU at $0.0816/h; {CPU_PRICE_SOURCE}."]


def test_anatomy_table_has_a_column_per_category_any_run_holds(mixed_rows):
    """Activations: peak − 160 MiB of parameters, gradients and optimizer state. More than 1 MiB left after the
    step is an artifact; a category only the GPU run recorded is a dash elsewhere, and so is what no record
    holds ("other", the GPU run's activations left); a compiled run on a CPU has no anatomy."""
    assert tables.anatomy_table(mixed_rows) == "\n".join([
        "| run | parameters | gradients | optimizer state | activations | temporaries | other "
        "| communication buffers | peak | activations left after the step |",
        "|:--|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
        "| baseline | 40.0 | 40.0 | 80.0 | 540 | 0 | – | – | 700 | 0.500 |",
        "| amp | 40.0 | 40.0 | 80.0 | 190 | 0 | – | – | 350 | 1.00 |",
        "| compile | – | – | – | – | – | – | – | – | – |",  # its tracker saw eager code only
        "| short | 40.0 | 40.0 | 80.0 | 530 | 0 | – | – | 690 | 2.00 (artifact) |",
        "| gpu | 40.0 | 40.0 | 80.0 | 240 | 0 | – | 12.0 | 400 | – |"])


def test_epoch_table_lists_each_measured_epoch_and_dashes_what_it_lacks(mixed_rows):
    # per step: (72 − 8) / 32 = 2 s and (36 − 4) / 32 = 1 s; validation share 8 / 72 = 4 / 36 = 11%
    assert tables.epoch_table(mixed_rows) == "\n".join([
        "| run | time per epoch | optimizer steps | per step, data loading included | validations "
        "| validation time | validation share | epoch run |",
        "|:--|--:|--:|--:|--:|--:|--:|:--|",
        "| baseline | 72 s | 32 | 2 s | 2 | 8 s | 11% | baseline-epoch |",
        "| amp | 36 s | 32 | 1 s | 2 | 4 s | 11% | amp-epoch |",
        "| compile | 50 s | – | – | – | – | – | compile-epoch |"])
    assert tables.epoch_table(study_rows.build_rows([rec("baseline", 2000, 700)])) is None


def budget_rows() -> list[BudgetRow]:
    """A 1 GiB budget: baseline's confirmed peak exactly at it, and its batch + 5% too (so not over it); amp
    confirmed with its over-run above; checkpointing-block over the budget; compile out of memory before any
    batch; fused, whose over-run recorded no peak."""
    budget = 1024.0
    return [BudgetRow("baseline", budget, 76, 990.0, 1024.0, "ok", 1, 0.0, [], 1.0, 80, 1024.0),
            BudgetRow("amp", budget, 470, 1000.0, 1010.0, "ok", 2, 0.0, [], 470 / 76, 494, 1100.0),
            BudgetRow("checkpointing-block", budget, 600, 1000.0, 1100.0, "ok", 2, 0.0, []),
            BudgetRow("compile", budget, None, None, None, "oom", 1, 0.0, []),
            BudgetRow("fused", budget, 80, 1000.0, 1000.0, "ok", 1, 0.0, [], 80 / 76, 84, None)]


def test_budget_table_says_where_each_entry_ended():
    # 470 / 76 = 6.2×; 80 / 76 = 1.05 shows as 1.1×
    assert tables.budget_table(budget_rows()) == "\n".join([
        "| run | largest batch | predicted peak MiB | confirmed peak MiB | under budget | confirming runs "
        "| batch vs base | a few % more exceeds it |",
        "|:--|--:|--:|--:|:-:|--:|--:|:--|",
        "| baseline | 76 | 990 | 1,020 | yes | 1 | 1.0× | no: batch 80, 1,020 MiB |",
        "| amp | 470 | 1,000 | 1,010 | yes | 2 | 6.2× | yes: batch 494, 1,100 MiB |",
        "| checkpointing-block | 600 | 1,000 | 1,100 | no | 2 | – | not run |",
        "| compile | – | – | – | oom | 1 | – | not run |",
        "| fused | 80 | 1,000 | 1,000 | yes | 1 | 1.1× | unknown: batch 84 recorded no peak |"])


def test_technique_summary_gives_each_run_its_ratios_to_the_baseline(mixed_rows):
    """Neither the baseline nor a run that did not finish has a line. Epoch and cost ratios: 36 / 72 and
    50 / 72; the largest batch: only entries confirmed under the budget (amp's 470 / 76)."""
    assert tables.technique_summary(mixed_rows, budget_rows()) == "\n".join([
        "| run, against the baseline | peak memory | step time | its 95% interval | time per epoch "
        "| largest batch under the budget | cost per epoch |",
        "|:--|--:|:--|:--|--:|--:|--:|",
        "| amp | 0.50× | 0.71× (faster) | 0.700–0.762× (2 pairs) | 0.50× | 6.2× | 0.50× |",
        "| compile | – | 1.0× (no verdict: 1 repeat) | – (1 repeat) | 0.69× | – | 0.69× |",
        "| short | 0.99× | 0.50× (no verdict: 1 repeat) | – (1 repeat) | – | – | – |",
        "| gpu | 0.57× | 0.024× (no verdict: 1 repeat) | – (1 repeat) | – | – | – |"])


def test_a_run_with_an_epoch_against_a_baseline_without_one():
    """The baseline measured no epoch and amp no samples/s: their ratio and its cost per 1,000 are dashes."""
    amp = rec("amp", 1000, 400, index=1, precision="bf16-mixed")
    del amp["timing"]["samples_per_s"]
    failed = rec("fused", 2000, 700, index=2)
    failed["status"] = "failed"
    rows = study_rows.build_rows([rec("baseline", 2000, 700), amp, failed, epoch_record("amp", 36.0, 32, 4.0, 1)])
    assert tables.technique_summary(rows, []).splitlines()[2:] == [
        "| amp | 0.57× | 0.50× (no verdict: 1 repeat) | – (1 repeat) | – | – | – |"]
    assert tables.main_table(rows).splitlines()[3] == (
        "| amp | bf16-mixed, 128, AdamW for-loop | 400 | 0.57× | 1,000 | – (1 repeat) | 0.50× | – (1 repeat) "
        "| no verdict: 1 repeat | – | 50% | 36 s | $0.00082 | – | 2.20 |")


def gpu_record(name: str, world_size: object = 2, kind: str = "run") -> dict:
    """A run (or epoch, 360 s) on H100s: ``world_size`` of them; ``...`` leaves the key out."""
    record = epoch_record(name, 360.0, 32, 30.0) if kind == "epoch" else rec(name, 1000, 400)
    record["hardware"] = {"accelerator": "cuda", "device_name": "NVIDIA H100 80GB HBM3"}
    record["techniques"]["world_size"] = world_size
    if world_size is ...:
        del record["techniques"]["world_size"]
    return record


@pytest.mark.parametrize("world_size, devices", [(2, 2), (None, 1), (..., 1)])
def test_row_cost_prices_every_gpu_the_run_used(world_size, devices):
    """$2.50 per H100-hour: 1,000 samples at 128 samples/s and a 360 s epoch, on each of ``devices``."""
    records = [gpu_record("ddp", world_size), gpu_record("ddp", world_size, kind="epoch")]
    (row,) = study_rows.build_rows(records)
    source = f"H100 SXM $2.50/h, low end; {PRICE_SOURCE}"
    assert tables.row_cost(row) == (pytest.approx(devices * 2.50 * 360 / 3600),
                                    pytest.approx(devices * 2.50 * 1000 / 128 / 3600),
                                    MachinePrice(devices * 2.50, f"{devices} × H100 SXM", source))
    assert tables.price_notes([row]) == [f"Cost (estimate): {devices} × H100 SXM at ${devices * 2.5:g}/h; {source}."]


def test_row_cost_on_a_cpu():
    records = [rec("baseline", 2000, 700), epoch_record("baseline", 72.0, 32, 8.0)]
    (row,) = study_rows.build_rows(records)
    assert tables.row_cost(row) == (pytest.approx(72 * CPU_USD_PER_S), pytest.approx(1000 / 64 * CPU_USD_PER_S),
                                    MachinePrice(0.0816, "2 vCPU", CPU_PRICE_SOURCE))


def test_an_epoch_on_a_device_without_a_price_has_no_cost():
    """The runs' machine is priced, the epoch record names none: its cost is unknown, 1,000 samples' is not."""
    epoch = epoch_record("baseline", 72.0, 32, 8.0)
    del epoch["hardware"]
    (row,) = study_rows.build_rows([rec("baseline", 2000, 700), epoch])
    assert tables.row_cost(row)[:2] == (None, pytest.approx(1000 / 64 * CPU_USD_PER_S))
    assert tables.cost_cells(row)[0] == "–"  # measured, but not priced
    (unmeasured,) = study_rows.build_rows([rec("baseline", 2000, 700)])
    assert tables.cost_cells(unmeasured)[0] == "not measured"


def test_attention_table_keeps_the_benchmarks_order_of_implementations_and_sorts_lengths():
    """A length an implementation was not run at is a dash; an entry that is not a mapping is ignored."""
    result = {"results": [
        {"impl": "sdpa", "seq": 1024, "status": "ok", "peak_mib": 30.0, "median_ms": 20.0},
        {"impl": "naive", "seq": 256, "status": "ok", "peak_mib": 40.0, "median_ms": 12.0},
        {"impl": "sdpa", "seq": 256, "status": "ok", "peak_mib": 10.0, "median_ms": 9.0},
        {"impl": "naive", "seq": 4096, "status": "oom"},
        "not a result",
        {"impl": "sdpa", "seq": 4096, "status": "ok", "peak_mib": 150.0, "median_ms": 400.0}]}
    assert tables.attention_table(result) == "\n".join([
        "| sequence length | sdpa peak MiB | naive peak MiB | sdpa step ms | naive step ms |",
        "|:--|--:|--:|--:|--:|",
        "| 256 | 10.0 | 40.0 | 9.00 | 12.0 |",
        "| 1024 | 30.0 | – | 20.0 | – |",
        "| 4096 | 150 | oom | 400 | oom |"])


def planner_record(flops: float | None = 426.75e9) -> dict:
    """A record with what the planner needs: ResNet-18's 11,173,962 parameters, AdamW; ``flops`` per step."""
    record = rec("baseline", 1000, 400)
    record["flops"]["flops_per_step"] = flops
    record["memory"]["model_parameters"] = 11_173_962
    record["techniques"]["optimizer"] = "adamw"
    return record


def test_scaleout_row_formats_one_prediction():
    """8 GPUs at 150,000 samples/s against 1 at 20,000: 150,000 / (8 × 20,000) = 94%. The times sit just
    under a rounding step (0.2849 ms shows 0.28), so a factor of 1.001 shows."""
    prediction = planner.scale.StepPrediction(
        strategy="dp", devices=8, memory_mib={}, comm_bytes=75 * 2**20, comm_s=0.2849e-3, comm_exposed_s=0.1449e-3,
        bubble_of_compute=0.0, bubble_of_step=0.0, step_s=5.649e-3, samples_per_step=1024, samples_per_s=150_000.0,
        fits=True)
    assert tables.scaleout_row(prediction, 20_000.0) == [
        8, "1,024", "75.0", "0.28 ms (estimate)", "0.14 ms (estimate)", "5.6 ms (estimate)", "94% (estimate)"]


def test_scaleout_table_of_a_record(capsys):
    """One GPU: 426.75 GFLOP at airbench's 32.3 PFLOP / 420 s = 5.549 ms. Gradients: 4 bytes × 11,173,962
    parameters, of which a ring sends 2 (N − 1) / N: 74.6 MiB at 8, 85.1 MiB at 512; each bucket's ring pays
    2 (N − 1) latencies (the planner's), which grow to most of the step at 512."""
    a100 = planner.scale.FABRICS["A100 80GB"]
    assert tables.scaleout_table(planner_record()) == "\n".join([
        "| GPUs | global batch | gradient MiB sent per GPU per step | communication per step | of it exposed "
        "| step time | scaling efficiency |",
        "|:--|--:|--:|--:|--:|--:|--:|",
        "| 1 | 128 | 0 | 0 ms (estimate) | 0 ms (estimate) | 5.5 ms (estimate) | 100% (estimate) |",
        "| 8 | 1,024 | 74.6 | 0.28 ms (estimate) | 0.14 ms (estimate) | 5.7 ms (estimate) | 98% (estimate) |",
        "| 512 | 65,536 | 85.1 | 14 ms (estimate) | 10 ms (estimate) | 16 ms (estimate) | 35% (estimate) |",
        "",
        f"Planner assumptions: A100 80GB, 300 GB/s per GPU inside a node of 8 and 25 GB/s per GPU between nodes "
        f"({a100.source}); {planner.scale.LATENCY_SOURCE}; gradients in 25 MiB buckets, the last one exposed, "
        "the others hidden behind up to 100% of backward (backward = 2/3 of the step); rings only: from NCCL 2.4 "
        "on, trees take over where a ring's 2(N−1) latencies dominate, so at hundreds of GPUs the latency here is "
        "an upper bound."])
    assert tables.scaleout_table(planner_record(flops=None)) is None
    unknown = planner_record()
    del unknown["memory"]["model_parameters"]
    capsys.readouterr()
    assert tables.scaleout_table(unknown) is None
    assert capsys.readouterr() == ("", "report: no scale-out table (\"record is missing 'memory.model_parameters'\")\n")


def test_gpu_rate_is_the_planners_scaling_at_airbenchs_mfu():
    """MFU: airbench's 32.3 PFLOP / 420 s over the A100's 312 TFLOP/s; a step at that MFU of the GPU's peak,
    and the efficiency at N: samples/s at N over N × samples/s at 1, on that GPU's network."""
    record = planner_record()
    mfu = 32.3e15 / 420 / 312e12
    for device, peak in (("A100 80GB", 312e12), ("H100 SXM", 989.4e12)):
        rate = tables.gpu_rate(record, device, (1, 8, 512))
        assert rate[:3] == (device, peak, pytest.approx(mfu))
        spec = planner.spec_from_record(record)
        spec = dataclasses.replace(spec, step_time_ms=1e3 * 426.75e9 / (peak * mfu))
        speed = {count: planner.predict_step(spec, "dp", count, planner.Assumptions(device=device)).samples_per_s
                 for count in (1, 8, 512)}
        assert rate.efficiencies == pytest.approx({count: speed[count] / (count * speed[1]) for count in speed})
        assert rate.efficiencies[1] == 1 and rate.efficiencies[512] < rate.efficiencies[8] < 1


def test_gpu_cost_cells_follow_the_formula():
    """4 GPUs at 50% of 4 × 4 TFLOP/s × 25% MFU: 1 GFLOP per sample takes 0.5 ms. 2,021,062 samples: 1,010.5 s
    = 16.8 min, × 4 × $1.10/h = $1.2351 (just over a rounding step); 1,000,000 samples: 500 s, $0.61."""
    rate = tables.GpuRate("A100 80GB", 4e12, 0.25, {1: 1.0, 4: 0.5})
    assert tables.gpu_cost_cells(rate, 4, 1e9, (2_021_062, 1_000_000)) == [
        "4 × A100 80GB", "$1.10", "50%", "16.8 min", "$1.24", "8.33 min", "$0.61"]


def cost_records(epoch_s: float = 72.8) -> list[dict]:
    """One repeat of the planner's record and its epoch of 32 steps of 128 samples: 4,096 samples."""
    return [planner_record(), epoch_record("baseline", epoch_s, 32, 8.0)]


def test_cost_table_of_the_measured_epoch_and_a_full_training():
    """This machine: 72.8 s × $0.0816/h = $0.00165 (just over a rounding step); 1,500,000 samples at 72.8 s
    per 4,096: 7.41 h, $0.60. One A100: 3.33 GFLOP per sample at 25% (the MFU) of 312 TFLOP/s: 4,096 samples in
    177 ms, $0.000054 at $1.10/h; one H100 (989.4 TFLOP/s) 55.9 ms at $2.50/h. 8 and 512 GPUs: the planner's
    efficiencies (:func:`tables.gpu_rate`)."""
    (row,) = study_rows.build_rows(cost_records())
    assert tables.cost_table(row) == "\n".join([
        "| devices | price per device-hour | scaling efficiency | one epoch (4,096 samples): time | cost "
        "| full training (1,500,000 samples): time | cost |",
        "|:--|--:|--:|--:|--:|--:|--:|",
        "| 2 vCPU, this machine (measured) | $0.082 | – | 72.8 s | $0.0017 | 7.41 h | $0.60 |",
        "| 1 × A100 80GB | $1.10 | 100% | 178 ms | $0.000054 | 65 s | $0.020 |",
        "| 8 × A100 80GB | $1.10 | 98% | 22.8 ms | $0.000056 | 8.33 s | $0.020 |",
        "| 512 × A100 80GB | $1.10 | 35% | 0.977 ms | $0.00015 | 358 ms | $0.056 |",
        "| 1 × H100 SXM | $2.50 | 100% | 56 ms | $0.000039 | 20.5 s | $0.014 |",
        "| 8 × H100 SXM | $2.50 | 95% | 7.39 ms | $0.000041 | 2.71 s | $0.015 |",
        "| 512 × H100 SXM | $2.50 | 14% | 0.787 ms | $0.00028 | 288 ms | $0.10 |",
        "",
        "GPU rows are estimates: 3.33 GFLOP per sample (counted in the `baseline` record) at 25% of the GPU's bf16 "
        "datasheet peak (airbench's ResNet-18 on one A100; the same MFU assumed on the H100), the planner's "
        "data-parallel efficiency, and the low end of each listing: third-party GPU cloud listings (2026-05). This "
        "machine's full training is its measured epoch's rate scaled to the samples."])


def test_the_cost_notes_round_the_flops_per_sample_to_three_digits():
    """3.3350000017 GFLOP per sample rounds up: a billion and one FLOP per GFLOP would round it down."""
    records = cost_records()
    records[0]["flops"]["flops_per_step"] = 3.3350000017e9 * 128
    (row,) = study_rows.build_rows(records)
    assert "GPU rows are estimates: 3.34 GFLOP per sample (counted in the `baseline` record)" in tables.cost_table(row)


def without(records: list[dict], what: str) -> list[dict]:
    """``records`` lacking one thing the cost example needs."""
    run, epoch = records
    if what == "epoch":
        return [run]
    if what == "epoch samples":
        del epoch["timing"]["epoch_steps"]
    elif what == "price":
        for record in records:
            record["hardware"] = {"accelerator": "cuda", "device_name": "Example GPU"}
    elif what == "flops":
        run["flops"]["flops_per_step"] = None
    else:
        del run["techniques"]["effective_batch_size"]
    return records


@pytest.mark.parametrize("what", ["epoch", "epoch samples", "price", "flops", "batch"])
def test_no_cost_table_without_what_it_needs(what):
    (row,) = study_rows.build_rows(without(cost_records(), what))
    assert tables.cost_table(row) is None
