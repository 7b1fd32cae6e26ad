"""A node's role from flags and from the env://, PyTorchJob and SLURM conventions; host lists; contradictions."""

from __future__ import annotations

import pytest

from recycle.errors import ConfigError
from recycle.runtime.control.cluster_env import expand_hostlist, first_host, resolve_role, slurm_port


def test_nothing_set_is_a_single_node_on_loopback() -> None:
    role = resolve_role({})
    assert (role.nnodes, role.node_rank, role.master_addr, role.master_port) == (1, 0, "127.0.0.1", 0)
    assert all(source == "default" for _, source in role.sources)


def test_torchrun_env_names() -> None:
    role = resolve_role({"MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29500", "NNODES": "4", "NODE_RANK": "3"})
    assert (role.nnodes, role.node_rank, role.master_addr, role.master_port) == (4, 3, "10.0.0.7", 29500)
    assert ("nnodes", "NNODES=4") in role.sources


def test_pytorchjob_names_agreeing_with_env_names() -> None:
    env = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "PET_MASTER_ADDR": "job-master-0",
           "PET_MASTER_PORT": "23456", "PET_NNODES": "3", "PET_NODE_RANK": "2", "WORLD_SIZE": "3", "RANK": "2"}
    role = resolve_role(env)
    assert (role.nnodes, role.node_rank, role.master_addr, role.master_port) == (3, 2, "job-master-0", 23456)


def test_pytorchjob_world_size_counts_pods_without_nproc_per_node() -> None:
    # A PyTorchJob without nprocPerNode sets WORLD_SIZE to the number of pods and RANK to the pod's index.
    role = resolve_role({"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "2", "RANK": "1"})
    assert (role.nnodes, role.node_rank) == (2, 1)


def test_world_size_of_processes_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"WORLD_SIZE='8' counts processes .*PET_NPROC_PER_NODE='4'.*NNODES"):
        resolve_role({"MASTER_PORT": "1234", "WORLD_SIZE": "8", "RANK": "0", "PET_NPROC_PER_NODE": "4"})
    # A node-level name wins: WORLD_SIZE may then count processes and is not read.
    role = resolve_role({"MASTER_PORT": "1234", "WORLD_SIZE": "8", "PET_NPROC_PER_NODE": "4", "PET_NNODES": "2",
                         "PET_NODE_RANK": "1"})
    assert (role.nnodes, role.node_rank) == (2, 1)


def test_slurm_names() -> None:
    env = {"SLURM_NNODES": "5", "SLURM_NODEID": "4", "SLURM_NTASKS": "5", "SLURM_JOB_ID": "123456",
           "SLURM_JOB_NODELIST": "node[07-09,12],gpu5"}
    role = resolve_role(env)
    assert (role.nnodes, role.node_rank, role.master_addr) == (5, 4, "node07")
    assert role.master_port == slurm_port("123456") == 15000 + 123456 % 20000
    # An exported MASTER_ADDR/MASTER_PORT (a common sbatch line) states the address; the host list only derives one.
    role = resolve_role({**env, "MASTER_ADDR": "10.1.1.7", "MASTER_PORT": "29400"})
    assert (role.master_addr, role.master_port) == ("10.1.1.7", 29400)


def test_slurm_step_nodelist_before_the_jobs() -> None:
    env = {"SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "a[1-4]",
           "SLURM_STEP_NODELIST": "a[3-4]"}
    assert resolve_role(env).master_addr == "a3"


def test_flags_win_over_the_environment() -> None:
    env = {"MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29500", "NNODES": "4", "NODE_RANK": "3"}
    role = resolve_role(env, nnodes=2, node_rank=0, master_addr="10.9.9.9", master_port=1111)
    assert (role.nnodes, role.node_rank, role.master_addr, role.master_port) == (2, 0, "10.9.9.9", 1111)
    assert dict(role.sources) == {"nnodes": "--nnodes", "node rank": "--node-rank", "master address": "--master-addr",
                                  "master port": "--master-port"}
    # A flag also settles a contradiction in the environment for its own setting.
    assert resolve_role({"NNODES": "2", "SLURM_NNODES": "3", "MASTER_PORT": "1"}, nnodes=2).nnodes == 2


@pytest.mark.parametrize("env, pattern", [
    ({"NNODES": "2", "SLURM_NNODES": "3", "MASTER_PORT": "1"},
     r"two values for --nnodes: NNODES='2' \(2\) but SLURM_NNODES='3'.*pass --nnodes"),
    ({"NODE_RANK": "1", "PET_NODE_RANK": "0"}, r"--node-rank: NODE_RANK='1' \(1\) but PET_NODE_RANK='0'"),
    ({"MASTER_ADDR": "a", "PET_MASTER_ADDR": "b"}, r"--master-addr: MASTER_ADDR='a'.*PET_MASTER_ADDR='b'"),
    ({"MASTER_PORT": "1", "PET_MASTER_PORT": "2"}, r"--master-port: MASTER_PORT='1'"),
])
def test_two_conventions_that_disagree_are_an_error(env: dict[str, str], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        resolve_role(env)


@pytest.mark.parametrize("env, pattern", [
    ({"NNODES": "two"}, r"NNODES='two' \(the env:// convention\) must be an integer >= 1"),
    ({"NNODES": "0"}, r"NNODES='0' .* must be an integer >= 1"),
    ({"SLURM_NODEID": "-1"}, r"SLURM_NODEID='-1' \(the SLURM convention\) must be an integer >= 0"),
    ({"MASTER_PORT": "70000"}, r"MASTER_PORT='70000' .* <= 65535"),
    ({"SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "node[01-"},
     r"SLURM_JOB_NODELIST='node\[01-' is not a SLURM host list.*MASTER_ADDR"),
    ({"SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_NTASKS": "16", "SLURM_JOB_ID": "1",
      "SLURM_JOB_NODELIST": "n[1-2]"}, r"SLURM_NTASKS='16' but SLURM_NNODES='2'.*--ntasks-per-node=1"),
    ({"NNODES": "2", "NODE_RANK": "0"}, r"2 nodes need a fixed store port.*MASTER_PORT"),
])
def test_bad_values_name_the_variable_and_the_fix(env: dict[str, str], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        resolve_role(env)


def test_hostlists() -> None:
    assert list(expand_hostlist("node[01-04,07],gpu5")) == ["node01", "node02", "node03", "node04", "node07", "gpu5"]
    assert list(expand_hostlist("rack[1-2]-n[8-9]")) == ["rack1-n8", "rack1-n9", "rack2-n8", "rack2-n9"]
    assert list(expand_hostlist("a,b.example.com,10.0.0.1")) == ["a", "b.example.com", "10.0.0.1"]
    assert list(expand_hostlist("n[098-101]")) == ["n098", "n099", "n100", "n101"]
    assert first_host("big[0000001-9999999]") == "big0000001"  # lazy: the range is not built
    for bad in ("", "n[1-2", "n1-2]", "n[a-b]", "n[3-1]", "a,,b", "n[1-[2]]"):
        with pytest.raises(ConfigError, match="is not a SLURM host list"):
            list(expand_hostlist(bad))


@pytest.mark.timeout(60)
def test_cli_reports_a_bad_variable_in_one_line(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from pathlib import Path

    from recycle.cli import main

    for name in ("SLURM_NNODES", "SLURM_NODEID", "PET_NNODES", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NNODES", "two")
    config = Path(__file__).resolve().parents[2] / "configs" / "tiny-gpt.toml"
    assert main(["train", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: NNODES='two'") and err.count("\n") == 1 and "Traceback" not in err
    monkeypatch.setenv("NNODES", "2")
    monkeypatch.setenv("SLURM_NNODES", "3")
    assert main(["train", "--config", str(config)]) == 2
    assert "two values for --nnodes" in capsys.readouterr().err
