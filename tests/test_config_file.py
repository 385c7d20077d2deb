"""`--config FILE.yaml` on every command (pagedserve/common/config_file.py): the file's flags
stand where --config stands, so later flags win; argparse refuses unknown ones."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedserve.cli import build_parser, main
from pagedserve.common.config_file import config_flags, expand_config


def test_a_file_becomes_the_commands_flags(tmp_path):
    path = tmp_path / "scheduler.yaml"
    path.write_text("max-num-seqs: 7\nmax_num_batched_tokens: 96\n--enable-prefix-caching: false\n"
                    "worker-addrs: [127.0.0.1:1, 127.0.0.1:2]\n")
    argv = expand_config(["scheduler", "--config", str(path), "--max-num-seqs", "9"])
    args = build_parser().parse_args(argv)
    assert args.max_num_seqs == 9 and args.max_num_batched_tokens == 96  # the later flag wins
    args = build_parser().parse_args(expand_config(["scheduler", "--max-num-seqs", "9", f"--config={path}"]))
    assert args.max_num_seqs == 7
    assert config_flags(path)[-4:] == ["--worker-addrs", "127.0.0.1:1", "--worker-addrs", "127.0.0.1:2"]


def test_every_command_takes_it():
    parser = build_parser()
    for argv in (["serve"], ["gateway"], ["scheduler"], ["tokenizer"], ["worker"], ["generate"],
                 ["bench", "throughput"]):
        assert hasattr(parser.parse_args(argv + ["--config", "x.yaml"]), "config"), argv


@pytest.mark.parametrize("text, needle", [("- a\n- b\n", "want a mapping"), ("a: {b: 1}\n", "has a mapping"),
                                          ("a: [\n", "not valid YAML"), ("config: other.yaml\n", "another")])
def test_bad_files_are_named(tmp_path, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=needle):
        config_flags(path)


def test_an_unknown_flag_is_refused_like_on_the_command_line(tmp_path, capsys):
    path = tmp_path / "typo.yaml"
    path.write_text("max-num-sequences: 4\n")
    with pytest.raises(SystemExit):
        main(["scheduler", "--config", str(path)])
    assert "--max-num-sequences" in capsys.readouterr().err
    assert main(["scheduler", "--config", str(tmp_path / "missing.yaml")]) == 2


def test_the_cli_reads_it(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("port: 1234\nmax-num-seqs: 5\n")
    out = subprocess.run([sys.executable, "-m", "pagedserve.cli", "serve", "--config", str(path), "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--config FILE.yaml" in out.stdout


def test_the_grafana_dashboard_reads_metrics_the_gateway_exposes():
    """docs/grafana/pagedserve.json: every metric its queries name is in /metrics (a render
    with scheduler stats and one finished request), with the model_name label it filters on."""
    import json
    import re
    from pathlib import Path

    from pagedserve.gateway.metrics import Metrics
    from pagedserve.v1 import scheduler_pb2

    dashboard = json.loads((Path(__file__).parent.parent / "docs/grafana/pagedserve.json").read_text())
    metrics = Metrics()
    metrics.model_name = "m"
    for histogram in (metrics.ttft, metrics.tpot, metrics.e2e):
        histogram.observe(0.1)
    metrics.stage.labels("scheduler_queue").observe(0.1)
    metrics.finished.labels("length").inc()
    metrics.http.labels("/v1/completions", "200").inc()
    text = metrics.render(scheduler_pb2.SchedulerStats(num_gpu_blocks=4, ready=True)).decode()
    exposed = {line.split("{")[0] for line in text.splitlines() if not line.startswith("#")}
    names = {name for panel in dashboard["panels"] for target in panel["targets"]
             for name in re.findall(r"pagedserve:[a-z0-9_]+", target["expr"])}
    names |= set(re.findall(r"pagedserve:[a-z0-9_]+", dashboard["templating"]["list"][1]["query"]))
    assert names and names <= exposed, names - exposed
    assert 'pagedserve:model_ready{model_name="m"}' in text
