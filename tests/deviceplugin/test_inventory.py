"""GPU inventories: a declared fake one for the host backend, NVML on GPU nodes."""

from __future__ import annotations

import pytest

from kvshare.deviceplugin.inventory import (
    FakeInventory,
    InventoryError,
    NvmlInventory,
    open_inventory,
    parse_fake_gpus,
)

GIB = 2**30


def test_fake_gpus_are_declared_by_count_and_size_with_stable_uuids() -> None:
    gpus = parse_fake_gpus("2x80Gi,1x40Gi", "node-a")
    assert [(g.index, g.total_bytes) for g in gpus] == [(0, 80 * GIB), (1, 80 * GIB), (2, 40 * GIB)]
    assert len({g.uuid for g in gpus}) == 3 and all(g.uuid.startswith("GPU-") for g in gpus)
    assert [g.uuid for g in parse_fake_gpus("2x80Gi,1x40Gi", "node-a")] == [g.uuid for g in gpus]
    assert parse_fake_gpus("16Gi", "node-b")[0].uuid != gpus[0].uuid  # per node


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [("", "expected COUNTxSIZE"), ("2xlots", "not a valid quantity"), ("0x8Gi", "1-64 GPUs"),
     ("1x128Mi", "at least 256Mi"), ("65x8Gi", "1-64 GPUs")],
)  # fmt: skip
def test_a_bad_fake_inventory_says_what_is_wrong(spec: str, fragment: str) -> None:
    with pytest.raises(InventoryError, match="--fake-gpus") as info:
        parse_fake_gpus(spec)
    assert fragment in str(info.value)


def test_fake_gpu_health_can_change() -> None:
    inventory = open_inventory("2x8Gi", "n")
    assert isinstance(inventory, FakeInventory) and inventory.backend == "host"
    sick = inventory.gpus()[1].uuid
    inventory.set_healthy(sick, False)
    assert [g.healthy for g in inventory.gpus()] == [True, False]
    assert inventory.process_memory(sick) is None  # the host backend audits memfds instead


def _nvml_works() -> bool:
    try:
        NvmlInventory().close()
    except InventoryError:
        return False
    return True


@pytest.mark.skipif(_nvml_works(), reason="NVML works here: the error path cannot be shown")
def test_without_nvml_the_agent_names_the_fake_inventory() -> None:
    with pytest.raises(InventoryError, match=r"--fake-gpus 1x16Gi"):
        open_inventory(None, "n")


@pytest.mark.gpu
@pytest.mark.skipif(not _nvml_works(), reason="needs an NVIDIA driver with NVML")
def test_nvml_lists_gpus_with_memory_health_and_processes() -> None:
    inventory = NvmlInventory()
    try:
        gpus = inventory.gpus()
        assert gpus and all(g.uuid.startswith("GPU-") and g.total_bytes > GIB for g in gpus)
        assert [g.index for g in gpus] == list(range(len(gpus)))
        assert all(g.healthy for g in gpus)
        assert inventory.process_memory(gpus[0].uuid) is not None
    finally:
        inventory.close()
