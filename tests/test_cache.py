"""How much memory the KV pool may take on CPU: a container's cgroup limit, at its root and at
the process's own group, v2 or v1's memory controller."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vegas_spec.cache import cgroup_room


def write(folder: Path, **files: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("_", ".", 1)).write_text(text)


def own(tmp_path: Path, text: str) -> str:
    path = tmp_path / "cgroup"
    path.write_text(text)
    return str(path)


def test_no_limit_anywhere_is_none(tmp_path: Path) -> None:
    write(tmp_path / "root", memory_max="max\n", memory_current="100\n")
    assert cgroup_room(str(tmp_path / "root"), own(tmp_path, "0::/\n")) is None
    assert cgroup_room(str(tmp_path / "absent"), str(tmp_path / "absent")) is None


def test_v2_root_and_own_group_take_the_smaller_room(tmp_path: Path) -> None:
    root = tmp_path / "root"
    write(root, memory_max="8000\n", memory_current="1000\n")
    assert cgroup_room(str(root), own(tmp_path, "0::/\n")) == 7000
    write(root / "job", memory_max="3000\n", memory_current="500\n")
    assert cgroup_room(str(root), own(tmp_path, "0::/job\n")) == 2500


def test_v1_memory_controller_of_the_process(tmp_path: Path) -> None:
    """A v1 hierarchy (the memory controller's line names the group); an unlimited group
    writes a huge number, which is no limit."""
    root = tmp_path / "root"
    write(root / "memory" / "box" / "t3g", memory_limit_in_bytes=str(3 << 30),
          memory_usage_in_bytes=str(1 << 30))
    lines = "4:memory:/box/t3g\n3:cpuset:/\n0::/\n"
    assert cgroup_room(str(root), own(tmp_path, lines)) == 2 << 30
    write(root / "memory" / "box" / "t3g", memory_limit_in_bytes="9223372036854771712")
    assert cgroup_room(str(root), own(tmp_path, lines)) is None


@pytest.mark.parametrize("limit", ["", "abc"])
def test_an_unreadable_limit_is_no_limit(tmp_path: Path, limit: str) -> None:
    write(tmp_path / "root", memory_max=limit, memory_current="1")
    assert cgroup_room(str(tmp_path / "root"), own(tmp_path, "0::/\n")) is None


def test_gather_slots_is_advanced_indexing() -> None:
    """`gather_slots` (index_select) gives `cache[slots]` for slots of any shape."""
    from vegas_spec.cache import gather_slots

    cache = torch.randn(40, 3, 8)
    for shape in [(5,), (2, 7), (2, 1, 6)]:
        slots = torch.randint(-40, 40, shape)  # negative: from the end, as indexing
        assert torch.equal(gather_slots(cache, slots), cache[slots])


def test_gather_head_slots_is_advanced_indexing_per_head() -> None:
    """`gather_head_slots` gives `cache[slots, head]`: each kv head at its own slots."""
    from vegas_spec.cache import gather_head_slots

    cache = torch.randn(40, 3, 8)
    head = torch.arange(3)[:, None]  # broadcast along each slot list
    for shape in [(3, 5), (2, 3, 7), (2, 1, 3, 4)]:
        slots = torch.randint(-40, 40, shape)  # negative: from the end, as indexing
        assert torch.equal(gather_head_slots(cache, slots), cache[slots, head])
