"""torch's CPU allocator with large-block reuse (plugins/csrc/block_cache.cpp): installed with the native library,
reuses freed blocks of about the same size, keeps no more than its cap, leaves small tensors to torch, and hands
out memory that behaves like any tensor's."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from kiln.plugins import block_cache
from kiln.plugins import native as native_lib

MB = 1 << 20


@pytest.fixture
def lib(native):
    lib = native_lib.library()
    before = block_cache.stats(lib)
    assert before is not None, "the native library's load installs the block cache by default"
    yield lib
    block_cache.install(lib, before.cap_bytes, before.min_bytes)


def test_installed_at_load_with_the_default_bounds(lib):
    s = block_cache.stats(lib)
    assert (s.cap_bytes, s.min_bytes) == (1024 * MB, 16 * MB)


def test_a_freed_large_block_serves_the_next_tensor_of_its_size(lib):
    a = torch.empty(48 * MB // 4)
    ptr = a.data_ptr()
    del a
    before = block_cache.stats(lib)
    assert before.cached_bytes >= 48 * MB
    b = torch.empty(47 * MB // 4)  # a little smaller: the same 2 MiB-rounded block
    after = block_cache.stats(lib)
    assert b.data_ptr() == ptr and after.hits == before.hits + 1
    assert after.cached_bytes == before.cached_bytes - 48 * MB


def test_small_tensors_are_torchs(lib):
    before = block_cache.stats(lib)
    for _ in range(100):
        t = torch.empty(1 * MB // 4)
        del t
    after = block_cache.stats(lib)
    assert (after.hits, after.misses, after.cached_bytes) == (before.hits, before.misses, before.cached_bytes)


def test_the_cap_bounds_what_is_kept(lib):
    block_cache.install(lib, cap_bytes=40 * MB, min_bytes=16 * MB)
    assert block_cache.stats(lib).cached_bytes <= 40 * MB  # lowering the cap frees the oldest blocks at once
    big = torch.empty(64 * MB // 4)  # bigger than the cap: freed, not kept
    del big
    assert block_cache.stats(lib).cached_bytes <= 40 * MB
    blocks = [torch.empty(18 * MB // 4) for _ in range(3)]  # 3 x 18 MiB freed: the oldest is returned
    del blocks
    s = block_cache.stats(lib)
    assert s.cached_bytes <= 40 * MB and s.cached_blocks == 2
    block_cache.install(lib, cap_bytes=0, min_bytes=16 * MB)  # cap 0: nothing is kept
    t = torch.empty(20 * MB // 4)
    del t
    assert block_cache.stats(lib).cached_bytes == 0


def test_reused_memory_behaves_like_any_tensors(lib, tmp_path):
    n = 40 * MB // 4
    a = torch.randn(n)
    ref = a.clone()
    del a
    b = torch.empty(n)
    b.copy_(ref)
    assert torch.equal(b, ref) and torch.equal(torch.from_numpy(b.numpy().copy()), ref)
    torch.save(b, tmp_path / "t.pt")
    assert torch.equal(torch.load(tmp_path / "t.pt"), ref)
    r = torch.empty(0)
    r.resize_(n)  # a storage that grows past the threshold
    r.copy_(ref)
    assert torch.equal(r, ref)
    s = ref.view(-1, 1024)
    assert torch.equal((s @ torch.eye(1024)).reshape(-1), ref)


def test_threads_allocating_and_freeing_at_once(lib):
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            g = torch.Generator().manual_seed(seed)
            for i in range(20):
                t = torch.full(((17 + (seed + i) % 5) * MB // 4,), float(seed))
                assert t[-1].item() == float(seed)
                del t
            torch.randn(8, generator=g)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert block_cache.stats(lib).cached_bytes <= block_cache.stats(lib).cap_bytes


def test_bad_settings_name_the_variable(monkeypatch):
    monkeypatch.setenv("KILN_CPU_BLOCK_CACHE_MB", "lots")
    with pytest.raises(ValueError, match="KILN_CPU_BLOCK_CACHE_MB='lots' is not a number of MiB"):
        block_cache.configured_bounds()
    monkeypatch.setenv("KILN_CPU_BLOCK_CACHE_MB", "-5")
    with pytest.raises(ValueError, match="negative"):
        block_cache.configured_bounds()
    monkeypatch.setenv("KILN_CPU_BLOCK_CACHE_MB", "256")
    monkeypatch.setenv("KILN_CPU_BLOCK_CACHE_MIN_MB", "8")
    assert block_cache.configured_bounds() == (256 * MB, 8 * MB)


@pytest.mark.parametrize("value, installed", [("0", False), ("lots", False), ("64", True)])
def test_the_environment_decides_at_load(native, value, installed):
    code = ("import warnings; warnings.simplefilter('ignore')\n"
            "from kiln.plugins import native, block_cache\n"
            "s = block_cache.stats(native.library())\n"
            "print(None if s is None else s.cap_bytes)")
    env = {**os.environ, "KILN_CPU_BLOCK_CACHE_MB": value}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (str(int(value) * MB) if installed else "None")
