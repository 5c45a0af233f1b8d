"""Putting names back as a timeline point kept them: first prepared, then applied.

``prepare`` makes every new object the rewind needs and checks every write it will do,
touching nothing the user has; only ``Plan.apply`` changes the namespace and the live
objects, with steps that cannot fail half way on their own (assigning names, copying
data between arrays already checked alike, refilling containers). A failure while
preparing leaves the kernel as it was.

Identity is kept where it can be:

- A name whose value then was an object still held, unchanged, by a name the rewind does
  not touch is bound to that very object.
- Names bound to one object then are bound to one object again (their copies are one).
- A restored value is written INTO the live object where both have the same structure:
  NumPy arrays and PyTorch tensors of the same type, shape and dtype (and device) get the
  data copied back; lists, dicts, sets and plain objects (a ``torch.nn.Module``, an
  optimizer) are refilled in place, their parts matched the same way. So an optimizer's
  parameters remain the model's parameters, and a reference held elsewhere sees the
  restored data. A live object that a name outside the rewind can reach is never written.
"""

from __future__ import annotations

import copy
import sys
import types
from dataclasses import dataclass, field
from typing import Any

from .copies import Entry, fresh_copy
from .fingerprint import (
    is_numpy_array,
    is_pandas_object,
    is_torch_module,
    is_torch_tensor,
    root_array,
)

_MATCH_DEPTH = 6
_MATCH_ITEMS = 10_000
_PROTECT_DEPTH = 4
_PROTECT_ITEMS = 1_000


@dataclass
class Plan:
    """A prepared rewind: what ``apply`` will write, and what the report says."""

    namespace: dict[str, Any]
    binds: dict[str, Any] = field(default_factory=dict)
    removes: list[str] = field(default_factory=list)
    refills: list[tuple[str, Any, Any]] = field(default_factory=list)
    not_restored: list[dict[str, str]] = field(default_factory=list)

    def apply(self) -> None:
        for kind, live, content in self.refills:
            _refill(kind, live, content)
        self.namespace.update(self.binds)
        for name in self.removes:
            self.namespace.pop(name, None)


def protected_ids(namespace: dict[str, Any], untouched: list[str]) -> set[int]:
    """The objects the names a rewind leaves alone can reach (a bounded walk)."""
    seen: set[int] = set()
    stack = [(namespace[name], 0) for name in untouched if name in namespace]
    while stack:
        value, depth = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if depth >= _PROTECT_DEPTH or isinstance(value, (str, bytes, int, float, type,
                                                         types.ModuleType)):
            continue
        items: list[Any] = []
        if isinstance(value, dict):
            items = list(value.values())[:_PROTECT_ITEMS]
        elif isinstance(value, (list, tuple, set, frozenset)):
            items = list(value)[:_PROTECT_ITEMS]
        elif isinstance(getattr(value, "__dict__", None), dict):
            items = list(value.__dict__.values())[:_PROTECT_ITEMS]
        if is_torch_tensor(value) and value.is_leaf and value.grad is not None:
            items.append(value.grad)
        stack.extend((item, depth + 1) for item in items)
    return seen


def prepare(namespace: dict[str, Any], targets: dict[str, tuple[Entry, int]],
            protected: set[int], untouched: dict[int, Any]) -> Plan:
    """The plan that puts every name of ``targets`` back to its entry.

    ``targets`` maps a name to its entry and the entry's age (a larger one is newer);
    ``untouched`` holds the values, by id, of names the rewind leaves alone.
    """
    plan = Plan(namespace)
    groups: dict[int, list[str]] = {}
    for name, (entry, _) in targets.items():
        if entry.kind == "absent":
            if name in namespace:
                plan.removes.append(name)
        elif entry.kind == "uncopied":
            plan.not_restored.append({"name": name, "reason": entry.reason})
        else:
            groups.setdefault(entry.live_id, []).append(name)
    memo: dict[int, Any] = {}
    pairs: dict[int, tuple[str, Any, Any]] = {}
    sources: dict[int, Entry] = {}
    guarded = set(protected)  # grows with the live objects already paired
    candidates: list[tuple[Entry, Any]] = []
    for live_id, names in groups.items():
        newest = max((targets[name] for name in names), key=lambda pair: pair[1])[0]
        sources[live_id] = newest
        if live_id in untouched or newest.kind == "reference":
            continue
        live = _live_candidate(namespace, names, live_id)
        if live is not None:
            candidates.append((newest, live))
    # The live objects that are the very objects of then take their parts first: a part
    # two values share goes back to the one that held it then.
    candidates.sort(key=lambda pair: id(pair[1]) != pair[0].live_id)
    for newest, live in candidates:
        _match(newest.value, live, 0, pairs, guarded)
    for stored_id, (_, _, live) in pairs.items():
        memo[stored_id] = live
    contents = {stored_id: _content(kind, stored, memo)
                for stored_id, (kind, stored, _) in pairs.items()}
    for live_id, names in groups.items():
        entry = sources[live_id]
        if live_id in untouched:
            value = untouched[live_id]
        elif entry.kind == "reference":
            value = entry.value
        else:
            value = fresh_copy(entry.value, memo)
        for name in names:
            plan.binds[name] = value
    plan.refills = [(kind, live, contents[stored_id] if kind not in ("array", "tensor")
                     else stored) for stored_id, (kind, stored, live) in pairs.items()]
    return plan


def _live_candidate(namespace: dict[str, Any], names: list[str], live_id: int) -> Any:
    present = [namespace[name] for name in names if name in namespace]
    for value in present:
        if id(value) == live_id:
            return value
    return present[0] if present else None


def _match(stored: Any, live: Any, depth: int, pairs: dict[int, tuple[str, Any, Any]],
           protected: set[int]) -> None:
    """Pair ``stored`` (a point's copy) with ``live`` where the live one can take its
    contents in place, and their parts likewise."""
    if id(stored) in pairs or type(stored) is not type(live) or id(live) in protected \
            or depth > _MATCH_DEPTH:
        return
    # One live object takes one stored object's contents, never two.
    protected.add(id(live))
    if is_numpy_array(stored):
        # A view writes its base's memory: never one whose base the rewind leaves alone.
        if stored.shape == live.shape and stored.dtype == live.dtype \
                and live.flags.writeable \
                and (live.base is None or id(root_array(live)) not in protected):
            pairs[id(stored)] = ("array", stored, live)
        return
    if is_torch_tensor(stored):
        if (stored.shape == live.shape and stored.dtype == live.dtype
                and stored.device == live.device and stored.layout == live.layout):
            pairs[id(stored)] = ("tensor", stored, live)
        return
    if is_pandas_object(stored) or isinstance(stored, (type, types.ModuleType,
                                                       types.FunctionType)):
        return
    kind = type(stored)
    if is_torch_module(stored):
        if _refilled_by_dict(kind):
            _match_model(stored, live, pairs, protected)
        return
    if kind is list:
        pairs[id(stored)] = ("list", stored, live)
        for old, new in list(zip(stored, live, strict=False))[:_MATCH_ITEMS]:
            _match(old, new, depth + 1, pairs, protected)
    elif kind is dict:
        pairs[id(stored)] = ("dict", stored, live)
        _match_values(stored, live, depth, pairs, protected)
    elif kind in (set,):
        pairs[id(stored)] = ("set", stored, live)
    elif kind is tuple:
        for old, new in list(zip(stored, live, strict=False))[:_MATCH_ITEMS]:
            _match(old, new, depth + 1, pairs, protected)
    elif _refilled_by_dict(kind) and isinstance(getattr(stored, "__dict__", None), dict) \
            and isinstance(getattr(live, "__dict__", None), dict):
        pairs[id(stored)] = ("object", stored, live)
        _match_values(stored.__dict__, live.__dict__, depth, pairs, protected)


def _match_model(stored: Any, live: Any, pairs: dict[int, tuple[str, Any, Any]],
                 protected: set[int]) -> None:
    """A PyTorch model and its submodules, however deep, matched by their qualified names,
    and their parameters and buffers by theirs: the live modules and tensors keep their
    identities (an optimizer's references to them hold), the tensors get the data back."""
    live_modules = dict(live.named_modules(remove_duplicate=False))
    for name, module in stored.named_modules(remove_duplicate=False):
        other = live_modules.get(name)
        if other is None or type(other) is not type(module) or id(module) in pairs \
                or (id(other) in protected and other is not live) \
                or not _refilled_by_dict(type(module)):
            continue
        protected.add(id(other))
        pairs[id(module)] = ("object", module, other)
        for table in ("_parameters", "_buffers"):
            mine, theirs = getattr(module, table, {}), getattr(other, table, {})
            for key, tensor in mine.items():
                if tensor is not None and theirs.get(key) is not None:
                    _match(tensor, theirs[key], 0, pairs, protected)


def _refilled_by_dict(kind: type) -> bool:
    """Whether an object of ``kind`` is all in its ``__dict__``: no slots, and copied the
    plain way (a class that copies or pickles itself its own way may hold more)."""
    plain: Any = object
    return getattr(kind, "__slots__", None) is None and not hasattr(kind, "__deepcopy__") \
        and getattr(kind, "__reduce_ex__", None) is plain.__reduce_ex__ \
        and getattr(kind, "__reduce__", None) is plain.__reduce__


def _match_values(stored: dict[Any, Any], live: dict[Any, Any], depth: int,
                  pairs: dict[int, tuple[str, Any, Any]], protected: set[int]) -> None:
    for key in list(stored)[:_MATCH_ITEMS]:
        if isinstance(key, (str, int)) and key in live:
            _match(stored[key], live[key], depth + 1, pairs, protected)


def _content(kind: str, stored: Any, memo: dict[int, Any]) -> Any:
    """What a paired live object will hold, made now (the apply only moves it in)."""
    if kind == "list":
        return copy.deepcopy(list(stored), memo)
    if kind == "dict":
        return copy.deepcopy(dict(stored), memo)
    if kind == "set":
        return copy.deepcopy(set(stored), memo)
    if kind == "object":
        return copy.deepcopy(dict(stored.__dict__), memo)
    return None


def _refill(kind: str, live: Any, content: Any) -> None:
    if kind == "array":
        import numpy as np  # the user's arrays are here: numpy is imported already

        np.copyto(live, content, casting="no")
    elif kind == "tensor":
        _refill_tensor(live, content)
    elif kind == "list":
        live[:] = content
    elif kind in ("dict", "set"):
        live.clear()
        live.update(content)
    elif kind == "object":
        live.__dict__.clear()
        live.__dict__.update(content)


def _refill_tensor(live: Any, stored: Any) -> None:
    torch = sys.modules["torch"]
    with torch.no_grad():
        live.copy_(stored)
        if not live.is_leaf:
            return
        grad = stored.grad
        if grad is None:
            live.grad = None
        elif live.grad is not None and live.grad.shape == grad.shape \
                and live.grad.dtype == grad.dtype and live.grad.device == grad.device:
            live.grad.copy_(grad)
        else:
            live.grad = grad.clone()
