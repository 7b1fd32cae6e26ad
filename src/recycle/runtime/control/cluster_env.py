"""A launcher node's role (nnodes, node rank, master address, port) from flags, else from the cluster's environment."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence, TypeVar

from recycle.errors import ConfigError

__all__ = ["NodeRole", "resolve_role", "expand_hostlist", "first_host", "slurm_port", "DEFAULT_ADDR"]

DEFAULT_ADDR = "127.0.0.1"  # a single-node run: the store listens on loopback only
SLURM_PORT_BASE, SLURM_PORT_SPAN = 15000, 20000  # SLURM names no port: every node derives the same one from the job id

# Each setting, the conventions that can state it, in the order they are reported. torchrun's env:// names and the
# ones Kubeflow's PyTorchJob sets (PET_* are torchrun's flags as environment variables) and SLURM's.
_NNODES = (("env://", "NNODES"), ("PyTorchJob", "PET_NNODES"), ("SLURM", "SLURM_NNODES"))
_NODE_RANK = (("env://", "NODE_RANK"), ("PyTorchJob", "PET_NODE_RANK"), ("SLURM", "SLURM_NODEID"))
_ADDR = (("env://", "MASTER_ADDR"), ("PyTorchJob", "PET_MASTER_ADDR"))
_PORT = (("env://", "MASTER_PORT"), ("PyTorchJob", "PET_MASTER_PORT"))
_PROCS_PER_NODE = ("PET_NPROC_PER_NODE", "LOCAL_WORLD_SIZE")

T = TypeVar("T")  # the type of one setting in resolve_role


@dataclass(frozen=True)
class NodeRole:
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int  # 0: any free port (single node only)
    sources: tuple[tuple[str, str], ...] = ()  # (setting, where it came from: "--flag", "VAR=value" or "default")

    def describe(self) -> str:
        """One line for the log: where each setting came from."""
        return "; ".join(f"{name} from {source}" for name, source in self.sources)


def resolve_role(env: Mapping[str, str], nnodes: int | None = None, node_rank: int | None = None,
                 master_addr: str | None = None, master_port: int | None = None) -> NodeRole:
    """Each setting from its flag when given (not None), else from the environment, else the single-node default.
    Two conventions that state different values, or a value that does not parse, raise a ConfigError."""
    sources: list[tuple[str, str]] = []

    def pick(name: str, flag: str, given: T | None, candidates: Sequence[tuple[str, str, T]], default: T) -> T:
        if given is not None:
            sources.append((name, flag))
            return given
        if candidates:
            first = candidates[0]
            for other in candidates[1:]:
                if other[2] != first[2]:
                    raise ConfigError(
                        f"the environment states two values for {flag}: {first[0]}={first[1]!r} ({first[2]!r}) but "
                        f"{other[0]}={other[1]!r}; every convention that is set must agree, so unset one of them or "
                        f"pass {flag} explicitly (a flag wins over the environment)")
            sources.append((name, f"{first[0]}={first[1]}"))
            return first[2]
        sources.append((name, "default"))
        return default

    slurm = "SLURM_NNODES" in env or "SLURM_NODEID" in env
    nnodes_env = _ints(env, _NNODES, minimum=1)
    rank_env = _ints(env, _NODE_RANK, minimum=0)
    if not nnodes_env:
        nnodes_env = _world_size_as_nodes(env, "WORLD_SIZE", minimum=1)
    if not rank_env:
        rank_env = _world_size_as_nodes(env, "RANK", minimum=0)
    used_slurm = (nnodes is None and any(v.startswith("SLURM_") for v, _, _ in nnodes_env)) or \
        (node_rank is None and any(v.startswith("SLURM_") for v, _, _ in rank_env))
    if used_slurm:
        _check_one_task_per_node(env)

    role_nnodes = pick("nnodes", "--nnodes", nnodes, nnodes_env, 1)
    role_rank = pick("node rank", "--node-rank", node_rank, rank_env, 0)

    addr_env = [(var, env[var].strip(), env[var].strip()) for _, var in _ADDR if env.get(var, "").strip()]
    if not addr_env and slurm:
        # The first host of the step's (else the job's) node list is node 0: SLURM_NODEID counts from it.
        var = next((v for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if env.get(v)), None)
        if var is not None:
            addr_env = [(var, env[var], first_host(env[var], var))]
    role_addr = pick("master address", "--master-addr", master_addr, addr_env, DEFAULT_ADDR)
    _check_address(role_addr, dict(sources)["master address"])

    port_env = _ints(env, _PORT, minimum=1, maximum=65535)
    if not port_env and slurm and env.get("SLURM_JOB_ID"):
        port_env = [("SLURM_JOB_ID", env["SLURM_JOB_ID"], slurm_port(env["SLURM_JOB_ID"]))]
    role_port = pick("master port", "--master-port", master_port, port_env, 0)

    if role_nnodes > 1 and role_port == 0:
        raise ConfigError(f"{role_nnodes} nodes need a fixed store port that every node uses; pass --master-port "
                          "PORT or set MASTER_PORT (PET_MASTER_PORT in a PyTorchJob; under SLURM it is derived from "
                          "SLURM_JOB_ID)")
    return NodeRole(role_nnodes, role_rank, role_addr, role_port, tuple(sources))


# A host name (RFC 1123 labels), an IPv4 address or an IPv6 address (optionally in brackets, with a %zone).
_HOST = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})?(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})?)*\.?$")
_IPV6 = re.compile(r"^\[?[0-9A-Fa-f:.]{2,45}(%[A-Za-z0-9_.-]{1,32})?\]?$")


def _check_address(address: str, source: str) -> None:
    """Node 0's address must look like a host name or an IP address: an empty or malformed one made the C++ store
    client print socket errors until the timeout."""
    if _HOST.match(address) or (":" in address and _IPV6.match(address)):
        return
    where = "--master-addr" if source == "--master-addr" else f"the master address ({source})"
    raise ConfigError(f"{where} {address!r} is not a host name or IP address; give node 0's address, e.g. 10.0.0.1 or "
                      f"node0.cluster (a single-node run needs none: {DEFAULT_ADDR})")


def _ints(env: Mapping[str, str], names: tuple[tuple[str, str], ...], minimum: int,
          maximum: int | None = None) -> list[tuple[str, str, int]]:
    """(variable, raw value, int) for every convention's variable that is set, in order; a bad value raises."""
    found = []
    for convention, var in names:
        raw = env.get(var, "").strip()
        if raw:
            found.append((var, raw, _int(var, raw, minimum, maximum, convention)))
    return found


def _int(var: str, raw: str, minimum: int, maximum: int | None, convention: str) -> int:
    bound = f"an integer >= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < minimum or (maximum is not None and value > maximum):
        raise ConfigError(f"{var}={raw!r} (the {convention} convention) must be {bound}; fix the variable, unset "
                          "it, or pass the matching flag (--nnodes, --node-rank, --master-port), which wins")
    return value


def _world_size_as_nodes(env: Mapping[str, str], var: str, minimum: int) -> list[tuple[str, str, int]]:
    """WORLD_SIZE and RANK count processes; they count nodes only with one process per node, as a PyTorchJob
    without nprocPerNode sets them. recycle starts one launcher per node, so only that reading is taken."""
    raw = env.get(var, "").strip()
    if not raw:
        return []
    for procs in _PROCS_PER_NODE:
        if env.get(procs, "").strip() not in ("", "1"):
            raise ConfigError(f"{var}={raw!r} counts processes ({procs}={env[procs].strip()!r} per node), but "
                              "recycle train runs one launcher per node, which starts that node's workers itself; "
                              "set NNODES and NODE_RANK (or pass --nnodes and --node-rank), or start one process per "
                              "node (nprocPerNode 1)")
    return [(var, raw, _int(var, raw, minimum, None, "env://"))]


def _check_one_task_per_node(env: Mapping[str, str]) -> None:
    """Under srun every task runs this command: more tasks than nodes would start several launchers on one node."""
    tasks, nodes = env.get("SLURM_NTASKS", "").strip(), env.get("SLURM_NNODES", "").strip()
    if tasks and nodes and tasks != nodes:
        raise ConfigError(f"SLURM_NTASKS={tasks!r} but SLURM_NNODES={nodes!r}: recycle train is one launcher per "
                          "node (it starts the node's workers itself); run it with `srun --ntasks-per-node=1`")


def slurm_port(job_id: str) -> int:
    """The store port every node of a SLURM job agrees on without talking: a function of the job id."""
    digits = re.sub(r"\D", "", job_id)  # array and het jobs: 1234_5, 1234+0
    if not digits:
        raise ConfigError(f"SLURM_JOB_ID={job_id!r} has no digits to derive the store port from; set MASTER_PORT "
                          "(or pass --master-port) on every node")
    return SLURM_PORT_BASE + int(digits) % SLURM_PORT_SPAN


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets: "a[1,3],b" -> ["a[1,3]", "b"]."""
    parts: list[str] = []
    current: list[str] = []
    depth = 0
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return parts


def _expand_one(pattern: str, var: str) -> Iterator[str]:
    """Every host of one entry, e.g. "gpu[01-03]-ib" -> gpu01-ib, gpu02-ib, gpu03-ib; brackets may repeat."""
    start = pattern.find("[")
    if start < 0:
        if "]" in pattern:
            raise _bad_hostlist(var, pattern)
        yield pattern
        return
    end = pattern.find("]", start)
    if end < 0 or "[" in pattern[start + 1:end]:
        raise _bad_hostlist(var, pattern)
    head, body, tail = pattern[:start], pattern[start + 1:end], pattern[end + 1:]
    for item in body.split(","):
        match = _RANGE.match(item.strip())
        if not match:
            raise _bad_hostlist(var, pattern)
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise _bad_hostlist(var, pattern)
        width = len(low)  # node[01-10]: zero-padded to the width of the lower bound, as SLURM writes it
        for number in range(int(low), int(high) + 1):
            for rest in _expand_one(tail, var):
                yield f"{head}{number:0{width}d}{rest}"


def expand_hostlist(nodelist: str, var: str = "SLURM_JOB_NODELIST") -> Iterator[str]:
    """The hosts of a SLURM compressed host list ("node[01-04,07],gpu5"), in order, lazily (no scontrol)."""
    text = nodelist.strip()
    if not text or text.count("[") != text.count("]"):
        raise _bad_hostlist(var, nodelist)
    for part in _split_top(text):
        if not part.strip():
            raise _bad_hostlist(var, nodelist)
        yield from _expand_one(part.strip(), var)


def first_host(nodelist: str, var: str = "SLURM_JOB_NODELIST") -> str:
    return next(expand_hostlist(nodelist, var))


def _bad_hostlist(var: str, value: str) -> ConfigError:
    return ConfigError(f"{var}={value!r} is not a SLURM host list (hosts and bracket ranges such as "
                       "'node[01-04,07],gpu5'); set MASTER_ADDR to node 0's address or pass --master-addr")
