"""ParallelConfig: errors name the field, the value and what is allowed."""

import pytest

from xlm.config import ParallelConfig
from xlm.engine.arg_utils import EngineArgs


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: ParallelConfig(tensor_parallel_size=0), "tensor_parallel_size=0"),
        (lambda: ParallelConfig(num_processes=2, process_id=2), r"process_id=2.*\[0, 2\)"),
        (lambda: ParallelConfig(coordinator_address="nohost"), "coordinator_address='nohost'"),
        (lambda: ParallelConfig(num_processes=2), "num_processes=2.*multihost"),
        (lambda: ParallelConfig(data_parallel_rank=1), r"data_parallel_rank=1.*\[0, 1\)"),
        (
            lambda: ParallelConfig(data_parallel_size=2, executor_backend="multihost"),
            "data_parallel_size=2.*'uni' engines",
        ),
        (
            lambda: EngineArgs(
                data_parallel_size=2, data_parallel_size_local=1
            ).create_parallel_config(),
            "data_parallel_address=None.*front end host's address",
        ),
        (
            lambda: ParallelConfig(
                data_parallel_size=2, data_parallel_size_local=1, data_parallel_address="h"
            ),
            "data_parallel_rpc_port=None",
        ),
        (
            lambda: ParallelConfig(data_parallel_size=2, data_parallel_size_local=3),
            r"data_parallel_size_local=3.*\[1, 2\]",
        ),
        (
            lambda: ParallelConfig(
                data_parallel_size=3, data_parallel_size_local=2, data_parallel_start_rank=2
            ),
            r"data_parallel_start_rank=2.*\[0, 1\]",
        ),
    ],
)
def test_invalid_values_name_field_and_value(factory, message):
    with pytest.raises(ValueError, match=message):
        factory()


def test_tensor_parallel_size_beyond_the_devices_names_both():
    from xlm.distributed.mesh import make_mesh

    with pytest.raises(ValueError, match=r"tensor_parallel_size=2.*1 device"):
        make_mesh(ParallelConfig(tensor_parallel_size=2))
