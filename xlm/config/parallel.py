"""ParallelConfig: the device mesh one engine spans, data-parallel ranks, multi-host set-up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from xlm.config.checks import _positive_int, _require


@dataclass
class ParallelConfig:
    """Device mesh and hosts: tensor and data parallel sizes, multi-host set-up."""

    # Devices one engine shards the model over (its `model` mesh axis).
    tensor_parallel_size: int = 1
    # Engine cores behind one front end (data parallelism at the client level): each rank
    # is its own process on its own group of tensor_parallel_size devices; the client
    # routes each request to one rank (xlm/engine/dp_client.py).
    data_parallel_size: int = 1
    # This engine's rank among them (the data-parallel client sets it per engine).
    data_parallel_rank: int = 0
    # Ranks on other hosts: this host runs data_parallel_size_local of the ranks (None:
    # all), from data_parallel_start_rank on; the front end (start rank 0) listens for the
    # others at data_parallel_address:data_parallel_rpc_port (xlm/engine/dp_remote.py).
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int = 0
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int | None = None
    # "uni": one process drives all local devices; "multihost": jax.distributed, one
    # process per host, process 0 schedules and the others follow.
    executor_backend: Literal["uni", "multihost"] = "uni"
    # multihost only; None lets JAX detect them (TPU pods, SLURM, ...).
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    # A TPU slice to compile for instead of the local devices ("v5e:2x2"): weights and KV
    # cache become sharded ShapeDtypeStructs and nothing runs (`xlm plan` only).
    target_topology: str | None = None

    def __post_init__(self) -> None:
        owner = "ParallelConfig"
        _positive_int(owner, "tensor_parallel_size", self.tensor_parallel_size)
        _positive_int(owner, "data_parallel_size", self.data_parallel_size)
        _require(
            isinstance(self.data_parallel_rank, int)
            and 0 <= self.data_parallel_rank < self.data_parallel_size,
            owner,
            "data_parallel_rank",
            self.data_parallel_rank,
            f"an integer in [0, {self.data_parallel_size})",
        )
        _require(
            self.executor_backend in ("uni", "multihost"),
            owner,
            "executor_backend",
            self.executor_backend,
            "'uni' or 'multihost'",
        )
        _positive_int(owner, "num_processes", self.num_processes, optional=True)
        if self.process_id is not None:
            limit = self.num_processes
            _require(
                isinstance(self.process_id, int)
                and self.process_id >= 0
                and (limit is None or self.process_id < limit),
                owner,
                "process_id",
                self.process_id,
                f"an integer in [0, {limit})" if limit else "an integer >= 0",
            )
        if self.coordinator_address is not None:
            host, _, port = self.coordinator_address.rpartition(":")
            _require(
                bool(host) and port.isdigit() and 0 < int(port) < 65536,
                owner,
                "coordinator_address",
                self.coordinator_address,
                "'host:port'",
            )
        self._check_data_parallel_hosts(owner)
        _require(
            self.data_parallel_size == 1 or self.executor_backend == "uni",
            owner,
            "data_parallel_size",
            self.data_parallel_size,
            "1 with executor_backend='multihost' (data-parallel ranks are 'uni' engines)",
        )
        if self.executor_backend == "uni":
            _require(
                self.num_processes in (None, 1),
                owner,
                "num_processes",
                self.num_processes,
                "1 with executor_backend='uni' (use 'multihost' for several processes)",
            )

    def _check_data_parallel_hosts(self, owner: str) -> None:
        """This host's share of the ranks, and where the others meet the front end."""
        size = self.data_parallel_size
        local = self.data_parallel_local_size
        _require(
            isinstance(local, int) and 1 <= local <= size,
            owner,
            "data_parallel_size_local",
            self.data_parallel_size_local,
            f"an integer in [1, {size}] (data_parallel_size={size})",
        )
        start = self.data_parallel_start_rank
        _require(
            isinstance(start, int) and 0 <= start <= size - local,
            owner,
            "data_parallel_start_rank",
            start,
            f"an integer in [0, {size - local}] (data_parallel_size - data_parallel_size_local)",
        )
        if local == size:
            return
        _require(
            bool(self.data_parallel_address),
            owner,
            "data_parallel_address",
            self.data_parallel_address,
            "the front end host's address when ranks run on other hosts "
            f"(data_parallel_size_local={local} < data_parallel_size={size})",
        )
        port = self.data_parallel_rpc_port
        _require(
            isinstance(port, int) and 0 <= port < 65536,
            owner,
            "data_parallel_rpc_port",
            port,
            "a port in [0, 65535] when ranks run on other hosts (0: any free port, "
            "logged by the front end)",
        )

    @property
    def data_parallel_local_size(self) -> int:
        """Data-parallel ranks this host runs."""
        local = self.data_parallel_size_local
        return self.data_parallel_size if local is None else local

    @property
    def world_size(self) -> int:
        """Devices one engine spans (each data-parallel rank is an engine of its own)."""
        return self.tensor_parallel_size

    @property
    def is_multihost(self) -> bool:
        return self.executor_backend == "multihost"
