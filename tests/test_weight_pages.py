"""kiln.runtime.weight_pages: the streamed weights are read from the file into one huge-page region, bit for bit,
without touching the mapping's pages of them (each weight held once, while loading too); the embedding table stays
mapped; KILN_HUGE_PAGE_WEIGHTS=0 keeps everything mapped."""

from __future__ import annotations

import os

import pytest
import torch

from kiln.contract import load_weights
from kiln.runtime import weight_pages


def _mapping_rss_kb(path) -> int:
    """Resident kB of this process's mappings of ``path``."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
                inside = head[-1] == str(path)
            elif inside and head[0] == "Rss:":
                total += int(head[1])
    return total


def test_streamed_weights_move_without_touching_their_mapped_pages(tmp_path):
    torch.manual_seed(0)
    tensors = {"embed_tokens.weight": torch.randn(1024, 1024), "layers_0_q4": torch.randint(0, 255, (3000, 1024),
               dtype=torch.uint8), "norm.weight": torch.randn(7), "lm_head": torch.randn(2048, 1024).bfloat16()}
    path = tmp_path / "rank0.weights"
    torch.save(tensors, path)
    mapped = load_weights(path)
    assert _mapping_rss_kb(path) < 64   # nothing read yet
    moved = weight_pages.to_huge_pages(mapped, path)
    assert set(moved) == set(tensors)
    assert _mapping_rss_kb(path) < 64   # the moved tensors came from the file, not through the mapping
    for name, t in tensors.items():
        assert moved[name].dtype == t.dtype and moved[name].shape == t.shape
        assert torch.equal(moved[name], t), name
    assert moved["embed_tokens.weight"] is mapped["embed_tokens.weight"]   # gathered by rows: stays mapped
    ptrs = sorted((moved[k].data_ptr(), k) for k in ("layers_0_q4", "norm.weight", "lm_head"))
    assert ptrs[0][0] % weight_pages.HUGE_PAGE == 0 and all(p % weight_pages.ALIGN == 0 for p, _ in ptrs)
    assert _mapping_rss_kb(path) <= 4096 + 64   # comparing read only the embedding table through the mapping
    del mapped
    assert torch.equal(moved["lm_head"], tensors["lm_head"])   # the region outlives the file's tensors


def test_the_engines_gathered_tables_stay_mapped(tmp_path):
    """The engine's memory plan names the tables that only row lookups read; every other weight moves (an
    "embed_tokens" table a tied LM head streams whole included)."""
    tensors = {"embed_tokens.weight": torch.randn(512, 256), "embed_positions.weight": torch.randn(64, 256),
               "w": torch.randn(256, 256)}
    path = tmp_path / "rank0.weights"
    torch.save(tensors, path)
    mapped = load_weights(path)
    moved = weight_pages.to_huge_pages(mapped, path, gathered=["embed_positions.weight"])
    assert moved["embed_positions.weight"] is mapped["embed_positions.weight"]
    assert moved["embed_tokens.weight"] is not mapped["embed_tokens.weight"]
    assert torch.equal(moved["embed_tokens.weight"], tensors["embed_tokens.weight"])
    assert weight_pages.streamed("embed_tokens.weight") is False   # an engine that did not record them: by name
    assert weight_pages.streamed("embed_tokens.weight", []) is True


def test_a_truncated_file_is_an_error(tmp_path):
    path = tmp_path / "rank0.weights"
    torch.save({"w": torch.randn(4096, 256)}, path)
    mapped = load_weights(path)
    os.truncate(path, path.stat().st_size - 200_000)
    with pytest.raises(OSError, match="weights file ended"):
        weight_pages.to_huge_pages(mapped, path)


def test_off_switch(monkeypatch):
    monkeypatch.setenv(weight_pages.ENV, "0")
    assert not weight_pages.enabled()
    monkeypatch.setenv(weight_pages.ENV, "1")
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    expected = os.path.exists(thp) and "[never]" not in open(thp).read()
    assert weight_pages.enabled() == expected
