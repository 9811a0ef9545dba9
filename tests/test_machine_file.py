"""Machine files (issue 41): one YAML format the planner plans from (``tiermem plan CFG --machine FILE``), the
bundled ones valid, each mistake one line naming the field (exit 2), several GPUs planned as one GPU's share,
``tiermem probe --save``'s file read back the same. Every plan here is from a fixed file, never timed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from tiermem.cli.main import main as tiermem
from tiermem.plan.machine import H200, Machine
from tiermem.plan.machine_file import (
    ADAMW_A_THREAD,
    ATTENTION_OF_PEAK,
    EXPERTS_OF_PEAK,
    STEP_OF_PEAK,
    describe,
    from_description,
    load_machine,
)

ROOT = Path(__file__).parent.parent
BUNDLED = sorted((ROOT / "configs" / "machines").glob("*.yaml"))
sys.path.insert(0, str(ROOT / "tools"))
from make_shape_run import SHAPES, parse, shape_of  # noqa: E402

SMALL = {"name": "small", "gpu": {"memory": "80GiB", "bf16_tflops": 989},
         "link": {"h2d": 50, "d2h": 40}, "host": {"memory": "256GiB", "cores": 34},
         "nvme": [{"read": 7, "write": 5, "size": "2TB"}, {"read": 7, "write": 5, "size": "2TB", "both": 1.2}]}


def train_yaml(tmp_path: Path, shape: str = "8b", nvme: bool = True, **model) -> Path:
    """A training YAML of a model shape (tools/make_shape_run.py's), 16 x 4096 tokens a step."""
    d = tmp_path / shape
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(dict(SHAPES[shape], **model)))
    cfg = {"model_name_or_path": str(d), "tiermem_init": "random", "stage": "pt", "dataset": "demo_pt",
           "dataset_dir": str(ROOT / "data"), "cutoff_len": 4096, "output_dir": str(tmp_path / "out"), "bf16": True,
           "per_device_train_batch_size": 4, "gradient_accumulation_steps": 4,
           "tiermem": {"tiers": {"nvme": {"path": str(tmp_path / "nvme")}}} if nvme else {}}
    path = tmp_path / f"{shape}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def write(tmp_path: Path, data: dict, name: str = "m.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return p


def cli(capsys, *argv) -> tuple[int, str, str]:
    rc = tiermem([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("path", BUNDLED, ids=lambda p: p.stem)
def test_the_bundled_machine_files_validate(path):
    m = load_machine(path)
    assert m.source.startswith(f"machine file {path}") and m.gpu_memory > 0 and m.ram > 0 and m.disk_free > 0
    data = yaml.safe_load(path.read_text())
    assert m.h2d == data["link"]["h2d"] * 1e9 and m.gpu_peak == data["gpu"]["bf16_tflops"] * 1e12


def test_the_four_named_machines_are_bundled():
    assert {p.stem for p in BUNDLED} >= {"h200-pcie5-125g", "h200-1.5tb", "gh200-480g", "8x-h200-2tb"}


def test_our_machine_file_holds_the_figures_the_planner_assumed_for_it():
    """h200-pcie5-125g is the H200 machine's measured figures, the same the planner assumes without a file, but
    for the compute's rates: fitted to this turn's runs (matmuls 623, attention 480 TFLOP/s beside a layer's cost a
    piece; the assumed 520 for both is an earlier session's figure)."""
    m = load_machine(ROOT / "configs/machines/h200-pcie5-125g.yaml")
    for k, v in H200.items():
        if k not in ("ram", "gpu_tflops", "gpu_attention_tflops"):
            assert getattr(m, k) == pytest.approx(v), k
    assert (m.gpu_tflops, m.gpu_attention_tflops) == (623e12, 480e12)
    assert m.ram == 125 << 30 and m.assumed == []


def test_a_file_converts_each_figure_and_adds_its_disks_up(tmp_path):
    m = load_machine(write(tmp_path, SMALL))
    assert (m.h2d, m.d2h, m.gpu_memory, m.ram) == (50e9, 40e9, 80 << 30, 256 << 30)
    assert (m.nvme_read, m.nvme_write, m.disk_free) == (14e9, 10e9, 4 * 10 ** 12)  # (striped: rates added)
    # not given: the H200's (named assumed) or estimated from the file's own figures (said in the source)
    assert m.gpu_tflops == pytest.approx(989e12 * STEP_OF_PEAK) == pytest.approx(623e12)
    assert m.gpu_attention_tflops == pytest.approx(989e12 * ATTENTION_OF_PEAK) == pytest.approx(480e12)
    assert m.cpu_adamw == pytest.approx(ADAMW_A_THREAD * 32)  # (all cores but two)
    assert m.gpu_expert_tflops == pytest.approx(989e12 * EXPERTS_OF_PEAK) == pytest.approx(236e12)
    assert "estimated: gpu_tflops, gpu_attention_tflops, cpu_adamw, gpu_expert_tflops" in m.source
    assert m.nvme_both == H200["nvme_both"] and "nvme_both" in m.assumed  # (one disk of two gave it: not all)
    assert {"duplex", "copy_drag", "gpu_adamw", "cpu_copy", "cpu_in_run", "pass_cost", "gpu_piece_rate",
            "gpu_expert_piece_rate", "gpu_expert_route_rate"} <= set(m.assumed)


def test_several_gpus_are_planned_as_one_gpus_share(tmp_path):
    m8 = load_machine(write(tmp_path, dict(SMALL, gpu=dict(SMALL["gpu"], count=8), host=dict(SMALL["host"], adamw=16))))
    assert m8.ram == (256 << 30) // 8 and m8.disk_free == 4 * 10 ** 12 // 8
    assert m8.cpu_adamw == pytest.approx(2e9) and m8.nvme_read == pytest.approx(14e9 / 8)
    assert m8.h2d == 50e9 and m8.gpu_memory == 80 << 30  # (each GPU's own)
    assert "one GPU's share of 8" in m8.source


@pytest.mark.parametrize("change,needle", [
    (lambda d: d["gpu"].pop("memory"), "gpu.memory: missing"),
    (lambda d: d["gpu"].update(bf16_tflops="fast"), "gpu.bf16_tflops: expected a number"),
    (lambda d: d["link"].update(h2d=-1), "link.h2d: expected a rate above 0"),
    (lambda d: d["host"].update(ram="1TiB"), "host.ram: unknown field"),
    (lambda d: d["host"].update(cores=0), "host.cores: expected a whole number"),
    (lambda d: d["host"].update(memory="lots"), "host.memory"),
    (lambda d: d["nvme"][1].pop("size"), "nvme[1].size: missing"),
    (lambda d: d["nvme"][0].update(both=5), "nvme[0].both: expected a ratio"),
    (lambda d: d.update(nvme={"read": 1}), "nvme: expected a list"),
    (lambda d: d.update(gpus=2), "unknown field 'gpus'"),
    (lambda d: d["gpu"].update(pass_ms=-1), "gpu.pass_ms: expected milliseconds from 0"),
    (lambda d: d["gpu"].update(piece_rate=0), "gpu.piece_rate: expected a rate above 0"),
    (lambda d: d.pop("link"), "link: expected a mapping"),
])
def test_a_bad_machine_file_is_one_line_naming_the_field(tmp_path, capsys, change, needle):
    data = json.loads(json.dumps(SMALL))
    change(data)
    path = write(tmp_path, data)
    rc, out, err = cli(capsys, "plan", train_yaml(tmp_path), "--machine", path)
    assert rc == 2 and err.count("\n") == 1 and needle in err and str(path) in err, err


@pytest.mark.parametrize("text", ["[1, 2]", "gpu: [", "rows_of: 3"])
def test_a_file_that_is_no_machine_file_is_one_line(tmp_path, capsys, text):
    path = tmp_path / "m.yaml"
    path.write_text(text)
    rc, out, err = cli(capsys, "plan", train_yaml(tmp_path), "--machine", path)
    assert rc == 2 and err.count("\n") == 1 and "not a machine file or probe file" in err, err


def test_machine_and_probe_together_are_refused(tmp_path, capsys):
    rc, out, err = cli(capsys, "plan", train_yaml(tmp_path), "--machine", BUNDLED[0],
                       "--probe", ROOT / "tests/golden/probe_h200.json")
    assert rc == 2 and err.count("\n") == 1 and "give one" in err


def test_what_a_probe_saves_reads_back_as_the_same_figures(tmp_path):
    """``tiermem probe --save`` writes ``describe``'s mapping: read back, the same figures, and what the probe
    assumed is assumed again."""
    m = Machine.from_probe(ROOT / "tests/golden/probe_h200.json")
    m.disk_free = 50 << 30
    back = from_description(describe(m, "p", "", 16, rows=[], size=1 << 20), "p.yaml")
    for k in ("h2d", "d2h", "nvme_read", "nvme_write", "cpu_adamw", "gpu_adamw", "gpu_memory", "ram", "disk_free"):
        assert getattr(back, k) == pytest.approx(getattr(m, k), rel=1e-3), k
    # (a file names the GPU's peak; a streamed layer's rate the probe did not give is estimated from it)
    assert set(back.assumed) == set(m.assumed) - {"gpu_peak", "gpu_tflops", "gpu_attention_tflops",
                                                  "gpu_expert_tflops"}
    assert "estimated: gpu_tflops, gpu_attention_tflops, gpu_expert_tflops" in back.source


def test_a_files_pass_cost_and_cost_a_piece_are_read_and_saved_back(tmp_path):
    """gpu.pass_ms (a pass's cost beyond the first, a group summed outside HBM; 0: none) and gpu.piece_rate (G
    params/s of a layer's cost a piece) are the file's, not assumed, and what a probe saves reads back the same;
    left out, they are the H200's, assumed."""
    m = load_machine(write(tmp_path, dict(SMALL, gpu=dict(SMALL["gpu"], piece_rate=120, pass_ms=0))))
    assert (m.gpu_piece_rate, m.pass_cost) == (120e9, 0.0) and not {"gpu_piece_rate", "pass_cost"} & set(m.assumed)
    back = from_description(describe(m, "p", "", 16), "p.yaml")
    assert (back.gpu_piece_rate, back.pass_cost) == (120e9, 0.0) and "pass_cost" not in back.assumed
    plain = load_machine(write(tmp_path, SMALL, "plain.yaml"))
    assert (plain.gpu_piece_rate, plain.pass_cost) == (H200["gpu_piece_rate"], H200["pass_cost"])
    assert {"gpu_piece_rate", "pass_cost"} <= set(plain.assumed)


def test_a_files_expert_figures_are_read_and_saved_back(tmp_path):
    """gpu.expert_tflops, expert_piece_rate and expert_route_rate (a mixture of experts' routed experts) are the
    file's, not assumed, and what a probe saves reads back the same; left out, the first is estimated from the peak,
    the others are the H200's, assumed."""
    gpu = dict(SMALL["gpu"], expert_tflops=200, expert_piece_rate=150, expert_route_rate=25)
    m = load_machine(write(tmp_path, dict(SMALL, gpu=gpu)))
    figures = ("gpu_expert_tflops", "gpu_expert_piece_rate", "gpu_expert_route_rate")
    assert tuple(getattr(m, k) for k in figures) == (200e12, 150e9, 25e9) and not set(figures) & set(m.assumed)
    back = from_description(describe(m, "p", "", 16), "p.yaml")
    assert tuple(getattr(back, k) for k in figures) == (200e12, 150e9, 25e9) and not set(figures) & set(back.assumed)
    plain = load_machine(write(tmp_path, SMALL, "plain.yaml"))
    assert (plain.gpu_expert_piece_rate, plain.gpu_expert_route_rate) == (174e9, 20e9)
    assert {"gpu_expert_piece_rate", "gpu_expert_route_rate"} <= set(plain.assumed)


def test_top_reads_a_saved_machine_files_rows(tmp_path):
    from tiermem.cli.top import ceilings

    rows = json.loads((ROOT / "tests/golden/probe_h200.json").read_text())["rows"]
    saved = write(tmp_path, dict(SMALL, rows=rows, size=1 << 30))
    assert ceilings(saved) == ceilings(ROOT / "tests/golden/probe_h200.json") != {}


def test_plan_with_a_machine_file_uses_its_sizes_and_rates(tmp_path, capsys):
    """The 8B shape on SMALL: DRAM's budget is 90% of its memory, NVMe's its disks' room; the compute is
    estimated at the file's GPU rate; the text names the file and the MFU against its peak."""
    rc, out, err = cli(capsys, "plan", train_yaml(tmp_path), "--machine", write(tmp_path, SMALL), "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["tiers"]["dram"]["budget"] == int((256 << 30) * 0.9)
    assert data["tiers"]["nvme"]["budget"] == 4 * 10 ** 12
    assert data["machine"]["gpu_tflops"] == pytest.approx(989e12 * STEP_OF_PEAK)
    pred = data["prediction"]
    assert pred["mfu"] == pytest.approx(pred["tflops"] / 989)
    # (attention counted beside 6·N: the 8B's 32 layers of 4096-wide queries at 4096-token rows, causal)
    attention = 32 * 12 * 4096 * 4096 / 2
    assert pred["tflops_attention"] == pytest.approx(pred["tflops"] * (1 + attention / data["workload"][
        "flops_per_token"]))
    rc, out, err = cli(capsys, "plan", train_yaml(tmp_path), "--machine", write(tmp_path, SMALL))
    assert rc == 0 and "machine: machine file" in out and "of 989 TFLOP/s" in out, err
    assert f"{pred['tflops']:.0f} TFLOP/s ({pred['tflops_attention']:.0f} with attention)" in out


def test_a_config_without_an_nvme_tier_is_told_the_machines_disks_go_unused(tmp_path, capsys):
    rc, out, err = cli(capsys, "plan", train_yaml(tmp_path, nvme=False), "--machine", write(tmp_path, SMALL))
    assert rc == 0, err
    assert out.splitlines()[-1] == ("note: the config names no NVMe tier, so the machine file's disks (3.6 TiB) are "
                                    "not used: set tiermem.tiers.nvme.path to plan with them")


def test_gpt_oss_120b_fits_the_15tb_machine_and_not_ours(tmp_path, capsys):
    """The seed's headline: gpt-oss-120B (1.9 TiB of state) is placed across HBM, 1.5 TiB of DRAM and the four
    disks of h200-1.5tb; on our H200 machine's file it is refused in one line."""
    cfg = train_yaml(tmp_path, "gpt-oss-120b")
    rc, out, err = cli(capsys, "plan", cfg, "--machine", ROOT / "configs/machines/h200-1.5tb.yaml", "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["model"]["params"] > 116e9 and data["tiers"]["nvme"]["need"] > 0 and data["tiers"]["dram"]["need"] > 0
    assert 0 < data["prediction"]["mfu"] < 1
    rc, out, err = cli(capsys, "plan", cfg, "--machine", ROOT / "configs/machines/h200-pcie5-125g.yaml")
    assert rc == 2 and err.count("\n") == 1 and "does not fit" in err
    assert "(the planned machine's disks have 58.0 GiB)" in err  # (that machine's disk, not this one's)


# the 14B run of issue 38 as it ran: its micro-batch whole (before the planner chose pieces) and its DRAM as the
# machine had it then (98.5 GiB of state there)
AS_IT_RAN = {"tiermem_physical_batch_size": 2, "dram": "99GiB"}


@pytest.mark.parametrize("shape,rows,accum,seq,measured,config", [
    pytest.param("3b", 4, 4, 4096, 3.051, {}, id="3b-16x4096"),
    pytest.param("8b", 4, 4, 4096, 6.95, {}, id="8b-16x4096"),
    pytest.param("8b", 1, 1, 131072, 50.8, {}, id="8b-131072-row"),
    # (fifteenth session: tools/gpu_long_check.sh, LLaMA-Factory's qwen3_full_sft_256k.yaml at its size)
    pytest.param("qwen3-8b", 1, 1, 204800, 125.7, {"rope_scaling": "yarn"}, id="qwen3-8b-yarn-204800-row"),
    # (a piece of 4096 tokens: the cost a piece; measured before auto merged micro-batches: pinned whole as it ran)
    pytest.param("8b", 2, 8, 2048, 3.84, {"tiermem_physical_batch_size": 2}, id="8b-16x2048"),
    pytest.param("14b", 1, 429, 2048, 265.9, {}, id="14b-429x2048", marks=pytest.mark.slow),  # (10 s: 429 pieces)
    pytest.param("14b", 2, 32, 4096, 117.8, AS_IT_RAN, id="14b-2x4096x32-nvme"),
])
def test_our_machine_file_predicts_the_runs_we_measured_within_10_percent(tmp_path, capsys, shape, rows, accum,
                                                                          seq, measured, config):
    """docs/measurements.md's runs on the H200 machine, planned from its machine file (no GPU, no timing)."""
    cfg = train_yaml(tmp_path, shape)
    data = yaml.safe_load(cfg.read_text())
    data.update(per_device_train_batch_size=rows, gradient_accumulation_steps=accum, cutoff_len=seq)
    data.update({k: v for k, v in config.items() if k != "dram"})
    if "dram" in config:
        data["tiermem"]["tiers"]["dram"] = {"budget": config["dram"]}
    cfg.write_text(yaml.safe_dump(data))
    rc, out, err = cli(capsys, "plan", cfg, "--machine", ROOT / "configs/machines/h200-pcie5-125g.yaml", "--json")
    assert rc == 0, err
    assert measured / json.loads(out)["prediction"]["step_seconds"] == pytest.approx(1.0, abs=0.10)


def moe_yaml(tmp_path: Path, shape: str, layers: int, experts: int | None, **settings) -> Path:
    """A training YAML of a mixture of experts' shape as the H200 runs made it (``tools/make_shape_run.py --shape
    SHAPE --layers N [--experts E] --accum 64``): 64 micro-batches of one 4096-token row a step."""
    argv = ["--shape", shape, "--dir", str(tmp_path), "--layers", str(layers)] + (
        ["--experts", str(experts)] if experts else [])
    cfg = train_yaml(tmp_path, "8b")  # (its YAML; its model is this shape)
    (tmp_path / "8b" / "config.json").write_text(json.dumps(shape_of(parse(argv))))
    data = yaml.safe_load(cfg.read_text())
    data.update(per_device_train_batch_size=1, gradient_accumulation_steps=64, cutoff_len=4096, **settings)
    cfg.write_text(yaml.safe_dump(data))
    return cfg


# the runs a FLOP count of a mixture of experts leaves something out of (docs/measurements.md, "gpt-oss measured"):
# transformers' gpt-oss has no SDPA (its eager attention materialises every head's 4096 x 4096 scores), the template's
# Qwen3-MoE layer stacks every expert's weights each forward, Qwen3-Next ran transformers' PyTorch fallback of its
# linear attention (the GPU machine has neither flash-linear-attention nor causal-conv1d)
MISSED = pytest.mark.xfail(strict=True, reason="not in the estimate: docs/measurements.md, gpt-oss measured")


@pytest.mark.parametrize("shape,layers,experts,settings,measured,what", [
    # gpt-oss-120B through the template: the step at 2-row pieces as the run merged them, the compute at 1-row pieces
    # (its step waited on the disk, its update's state partly on NVMe beside ~60 GiB of page cache: not modelled)
    pytest.param("gpt-oss-120b", 2, None, {"tiermem_physical_batch_size": 2}, 6.38, "step", id="oss-2l-template"),
    pytest.param("gpt-oss-120b", 3, None, {"tiermem_physical_batch_size": 1}, 9.405, "compute",
                 id="oss-3l-template-compute"),
    pytest.param("qwen3-30b-a3b", 12, None, {"tiermem_model_path": "generic"}, 13.28, "step", id="qwen3moe-generic"),
    pytest.param("deepseek-v3", 5, 64, {}, 23.57, "step", id="dsv3-5l-64e-generic"),
    pytest.param("gpt-oss-120b", 2, None, {"tiermem_model_path": "generic"}, 14.58, "step", id="oss-2l-generic",
                 marks=MISSED),
    pytest.param("qwen3-30b-a3b", 12, None, {"tiermem_model_path": "template"}, 16.67, "step",
                 id="qwen3moe-template", marks=MISSED),
    pytest.param("qwen3-next-80b-a3b", 6, None, {}, 35.05, "step", id="qwen3next-6l-generic", marks=MISSED),
])
def test_our_machine_file_predicts_the_moe_runs_we_measured_within_10_percent(tmp_path, capsys, shape, layers,
                                                                              experts, settings, measured, what):
    """The mixture-of-experts runs on the H200 machine (fourteenth and fifteenth sessions), planned from its machine
    file: a routed expert's FLOPs at the experts' rate, the routing's rows and every expert's cost a piece."""
    cfg = moe_yaml(tmp_path, shape, layers, experts, **settings)
    rc, out, err = cli(capsys, "plan", cfg, "--machine", ROOT / "configs/machines/h200-pcie5-125g.yaml", "--json")
    assert rc == 0, err
    pred = json.loads(out)["prediction"]
    assert measured / pred["step_seconds" if what == "step" else "compute_seconds"] == pytest.approx(1.0, abs=0.10)
