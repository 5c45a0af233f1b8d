"""Choosing the GPUs a restored process goes onto, against made-up inventories of a node.

``plan_targets`` is pure, so every scenario here is data: what the snapshot recorded, what
the node has, what the user chose, and the plan or the refusal that must come out.
"""

from __future__ import annotations

from typing import Any

import pytest

from jupyter_gpu_snapshot.core.errors import InvalidRequest, NotReady, SnapshotError
from jupyter_gpu_snapshot.gpu.inventory import GpuDevice
from jupyter_gpu_snapshot.gpu.remap import (
    GPU_MARGIN_BYTES,
    GpuPlan,
    describe_choice,
    parse_gpu_choice,
    plan_targets,
    remap_notice,
    saved_gpus,
    visible_uuids,
)

GIB = 1 << 30
H200 = "NVIDIA H200"
H100 = "NVIDIA H100 80GB HBM3"
U = [f"GPU-{i}{i}{i}{i}{i}{i}{i}{i}-aaaa-bbbb-cccc-dddddddddddd" for i in range(4)]


def node(*gpus: tuple[str, str, int]) -> tuple[GpuDevice, ...]:
    """GPUs of a node: (uuid, model, free GiB), indexed in order."""
    return tuple(GpuDevice(i, uuid, name, 140 * GIB, (140 - free) * GIB, free * GIB)
                 for i, (uuid, name, free) in enumerate(gpus))


def section(uses: dict[str, int], saw: list[str], names: dict[str, str] | None = None,
            visible: list[str] | None = None) -> dict[str, Any]:
    """The manifest's gpu section: the node of the save had ``saw``; the kernel held ``uses``."""
    names = names or {}
    return {
        "devices": [{"index": i, "uuid": u, "name": names.get(u, H200), "memory_total": 0,
                     "memory_used": 0, "memory_free": 0} for i, u in enumerate(saw)],
        "visible": visible if visible is not None else saw,
        "processes": [{"pid": 10, "ns_pid": 2, "gpu_bytes": sum(uses.values()),
                       "devices": uses}],
    }


def moves(plan: GpuPlan) -> list[tuple[int, int]]:
    """(saved index, target index) for each device of the process, cuda:0 first."""
    return [(p.saved.index, p.target.index) for p in plan.placements]


def plan(gpu: dict[str, Any], here: tuple[GpuDevice, ...], chosen: list[str] | None = None,
         **kw: Any) -> GpuPlan:
    return plan_targets("snap1", saved_gpus(gpu), here, chosen, **kw)


# -- automatic choice ----------------------------------------------------------------------------
AUTOMATIC = [
    # (scenario, used GiB per saved GPU, node's GPUs as (saved GPU number, free GiB), expected)
    ("same GPUs with room stay", {0: 10}, [(0, 100), (1, 100)], [(0, 0), (1, 1)]),
    ("GPU 0 full: moves to GPU 1, the unused one swaps back", {0: 10}, [(0, 5), (1, 100)],
     [(0, 1), (1, 0)]),
    ("both used, one short: they swap", {0: 10, 1: 50}, [(0, 100), (1, 20)], [(0, 1), (1, 0)]),
    ("unused GPUs need no room", {1: 10}, [(0, 0), (1, 100)], [(0, 0), (1, 1)]),
    ("other UUIDs of the same model (another node)", {0: 10}, [(2, 100), (3, 100)],
     [(0, 0), (1, 1)]),
    ("a moved GPU leaves the others at home", {0: 10, 1: 50}, [(0, 100), (1, 20), (2, 60)],
     [(0, 0), (1, 2)]),
    ("the largest need picks first", {0: 10, 1: 90}, [(2, 100), (3, 95)], [(0, 1), (1, 0)]),
]


@pytest.mark.parametrize("scenario,used,here,expected",
                         AUTOMATIC, ids=[a[0] for a in AUTOMATIC])
def test_automatic_choice(scenario: str, used: dict[int, int], here: list[tuple[int, int]],
                          expected: list[tuple[int, int]]) -> None:
    gpu = section({U[i]: n * GIB for i, n in used.items()}, U[:2])
    chosen = plan(gpu, node(*[(U[i], H200, free) for i, free in here]))
    assert moves(chosen) == expected, scenario
    pairs = chosen.pairs()
    if expected == [(0, 0), (1, 1)] and here[0][0] == 0:
        assert pairs == [] and not chosen.remapped  # same GPUs: the driver needs no pairs
    else:
        # Always the full permutation: a pair for every GPU the process could see.
        assert [old for old, _ in pairs] == U[:2]
        assert sorted(new for _, new in pairs) == sorted(d.uuid for d in chosen_targets(chosen))
        assert len({new for _, new in pairs}) == 2


def chosen_targets(p: GpuPlan) -> list[GpuDevice]:
    return [pl.target for pl in p.placements]


def test_a_gpu_kept_by_uuid_is_moved_when_it_lacks_room_and_the_pairs_say_so() -> None:
    gpu = section({U[0]: 30 * GIB}, U[:2])
    chosen = plan(gpu, node((U[0], H200, 2), (U[1], H200, 100)))
    assert chosen.pairs() == [(U[0], U[1]), (U[1], U[0])]
    assert chosen.to_dict()["devices"][0] == {
        "device": "cuda:0", "from": {"index": 0, "uuid": U[0], "name": H200},
        "to": {"index": 1, "uuid": U[1], "name": H200}, "bytes": 30 * GIB}


def test_the_margin_counts() -> None:
    gpu = section({U[0]: 10 * GIB}, U[:1])
    exact = GpuDevice(0, U[0], H200, 140 * GIB, 0, 10 * GIB + GPU_MARGIN_BYTES)
    assert not plan(gpu, (exact,)).remapped
    short = GpuDevice(0, U[0], H200, 140 * GIB, 0, 10 * GIB + GPU_MARGIN_BYTES - 1)
    with pytest.raises(NotReady, match="no choice of GPUs here has room"):
        plan(gpu, (short,))


REFUSALS = [
    # (scenario, used, saved names, node, error class, says)
    ("both full", {0: 50, 1: 50}, {}, [(U[0], H200, 10), (U[1], H200, 60)], NotReady,
     r"no choice of GPUs here has room for snapshot snap1: its process needs cuda:0 50\.0 GiB, "
     r"cuda:1 50\.0 GiB \(plus 256\.0 MiB each\), and this node's GPUs of its model have "
     r"GPU 0 \(NVIDIA H200, 10\.0 GiB free\); GPU 1 \(NVIDIA H200, 60\.0 GiB free\)"),
    ("another model", {0: 5}, {}, [(U[0], H100, 70), (U[1], H100, 70)], NotReady,
     r"the process of snapshot snap1 could see 2 NVIDIA H200 GPU\(s\); this node has 2 "
     r"NVIDIA H100 80GB HBM3"),
    ("too few of the model", {0: 5}, {}, [(U[0], H200, 70), (U[1], H100, 70)], NotReady,
     r"could see 2 NVIDIA H200 GPU\(s\); this node has 1 NVIDIA H100 80GB HBM3, 1 NVIDIA H200"),
]


@pytest.mark.parametrize("scenario,used,names,here,error,says", REFUSALS,
                         ids=[r[0] for r in REFUSALS])
def test_automatic_refusals(scenario: str, used: dict[int, int], names: dict[str, str],
                            here: list[tuple[str, str, int]], error: type[SnapshotError],
                            says: str) -> None:
    gpu = section({U[i]: n * GIB for i, n in used.items()}, U[:2], names)
    with pytest.raises(error, match=says) as err:
        plan(gpu, node(*here))
    assert err.value.step == "preflight" and err.value.hint


def test_a_driver_without_remap_refuses_a_move_but_not_the_same_gpus() -> None:
    gpu = section({U[0]: 10 * GIB}, U[:2])
    assert not plan(gpu, node((U[0], H200, 100), (U[1], H200, 100)),
                    remap_supported=False).remapped
    with pytest.raises(NotReady, match=r"cuda:0 from GPU 0 to GPU 1.*cannot restore onto "
                       r"other GPUs") as err:
        plan(gpu, node((U[0], H200, 1), (U[1], H200, 100)), remap_supported=False)
    assert "570" in (err.value.hint or "")


# -- the user's choice ---------------------------------------------------------------------------
def test_chosen_gpus_override_and_may_be_named_by_index_or_uuid() -> None:
    gpu = section({U[0]: 10 * GIB, U[1]: 5 * GIB}, U[:2])
    here = node((U[0], H200, 100), (U[1], H200, 100))
    swapped = plan(gpu, here, ["1", "0"])
    assert moves(swapped) == [(0, 1), (1, 0)] and swapped.chosen
    assert swapped.pairs() == [(U[0], U[1]), (U[1], U[0])]
    by_uuid = plan(gpu, here, [U[1].upper(), U[0]])
    assert moves(by_uuid) == [(0, 1), (1, 0)]
    same = plan(gpu, here, ["0", "1"])
    assert same.pairs() == [] and same.chosen


CHOICE_REFUSALS = [
    (["1"], InvalidRequest, r"gpus names 1 GPU\(s\), but the process of snapshot snap1 could "
     r"see 2 \(cuda:0 = NVIDIA H200, cuda:1 = NVIDIA H200\)"),
    (["0", "0"], InvalidRequest, r"GPU 0 for both cuda:0 and cuda:1: it must be a permutation"),
    (["0", "7"], InvalidRequest, r"gpus names '7' for cuda:1, which is no GPU of this node"),
    (["1", "2"], NotReady, r"cuda:1 of snapshot snap1 was a NVIDIA H200; GPU 2 chosen for it "
     r"is a NVIDIA H100 80GB HBM3"),
    (["3", "1"], NotReady, r"GPU 3 chosen for cuda:0 has 5\.0 GiB free; snapshot snap1 needs "
     r"10\.0 GiB there"),
]


@pytest.mark.parametrize("chosen,error,says", CHOICE_REFUSALS, ids=lambda c: str(c)[:20])
def test_a_chosen_gpu_that_does_not_fit_is_refused(chosen: list[str],
                                                   error: type[SnapshotError],
                                                   says: str) -> None:
    gpu = section({U[0]: 10 * GIB}, U[:2])
    here = node((U[0], H200, 100), (U[1], H200, 100), (U[2], H100, 70), (U[3], H200, 5))
    with pytest.raises(error, match=says) as err:
        plan(gpu, here, chosen)
    assert err.value.hint, "every refusal says what to do"


@pytest.mark.parametrize("given,expected", [
    ([1, 0], ["1", "0"]), ("1,0", ["1", "0"]), (" 0 ", ["0"]), ([U[1]], [U[1]]),
])
def test_gpu_choice_shapes(given: object, expected: list[str]) -> None:
    assert parse_gpu_choice(given) == expected


@pytest.mark.parametrize("given", [[], "", [True], [1.5], [-1], ["cuda:1"], [[0]], {"a": 1},
                                   ["GPU-" + "f" * 70], list(range(65))])
def test_gpu_choice_of_a_wrong_shape_is_refused(given: object) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_gpu_choice(given)
    assert err.value.step == "request" and "gpus" in err.value.message


# -- what the process could see ------------------------------------------------------------------
@pytest.mark.parametrize("value,expected", [
    (None, [0, 1, 2]), ("", []), ("2,0", [2, 0]), ("1,7,0", [1]), ("0,0", [0]),
    ("GPU-22", [2]), ("GPU-2222,1", [2, 1]), ("MIG-abc", []),
])
def test_visible_devices_follow_cuda_visible_devices(value: str | None,
                                                     expected: list[int]) -> None:
    here = node((U[0], H200, 1), (U[1], H200, 1), (U[2], H200, 1))
    assert visible_uuids(value, here) == [U[i] for i in expected]


def test_a_process_restricted_to_one_gpu_is_planned_on_that_gpu_alone() -> None:
    gpu = section({U[1]: 10 * GIB}, U[:2], visible=[U[1]])
    saved = saved_gpus(gpu)
    assert [(s.position, s.index) for s in saved] == [(0, 1)]
    chosen = plan(gpu, node((U[0], H200, 100), (U[1], H200, 1)))
    assert chosen.pairs() == [(U[1], U[0])]


def test_snapshots_without_a_visible_list_saw_every_gpu_in_index_order() -> None:
    gpu = section({U[0]: GIB}, U[:2])
    del gpu["visible"]
    gpu["devices"].reverse()
    assert [s.uuid for s in saved_gpus(gpu)] == U[:2]


def test_the_notice_names_every_move_and_what_is_stale() -> None:
    gpu = section({U[0]: 10 * GIB}, U[:2])
    moved = plan(gpu, node((U[0], H200, 1), (U[1], H200, 100))).to_dict()
    text = remap_notice(moved)
    assert moved["notice"] == text  # what clients (the magic, the restore dialog) show
    assert f"cuda:0 from GPU 0 ({U[0]}) to GPU 1 ({U[1]})" in text
    assert f"cuda:1 from GPU 1 ({U[1]}) to GPU 0 ({U[0]})" in text
    assert "NVML" in text and "PCI bus ids" in text and "unchanged" in text
    assert remap_notice(plan(gpu, node((U[0], H200, 100), (U[1], H200, 100))).to_dict()) == ""
    assert remap_notice(None) == ""


def test_describe_choice_shows_the_plan_or_the_refusal_without_raising() -> None:
    gpu = section({U[0]: 10 * GIB}, U[:2])
    here = node((U[0], H200, 1), (U[1], H200, 100))
    ahead = describe_choice("snap1", gpu, here, None, True)
    assert [d["device"] for d in ahead["devices"]] == ["cuda:0", "cuda:1"]
    assert ahead["plan"]["remapped"] and ahead["problem"] is None
    refused = describe_choice("snap1", gpu, here, ["0", "1"], True)
    assert refused["plan"] is None and refused["problem"]["code"] == "not_ready"
    old_driver = describe_choice("snap1", gpu, here, None, False)
    assert "cannot restore onto other GPUs" in old_driver["problem"]["cause"]
    nothing = describe_choice("snap1", None, here, None, True)
    assert nothing["devices"] == [] and nothing["plan"] is None and nothing["problem"] is None
    assert len(nothing["node"]) == 2
