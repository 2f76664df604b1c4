"""What looking at structured data from outside may cost: a bundle's ``manifest.yaml``, a node
file. YAML aliases let a few hundred bytes stand for billions of values (each ``*a`` repeats
what ``&a`` names, and ten names of ten repeats each are 10^10), or for a value that holds
itself: walking such data, or writing it into an error message, would not end. Both loaders
refuse it first (:func:`expansion_problem`), and error messages show values through
:func:`shown`, which writes at most a few lines of any value."""
from __future__ import annotations

import reprlib

#: values a manifest or a node file may hold once its aliases are expanded (real ones hold a few
#: hundred)
MAX_EXPANDED_VALUES = 100_000

_SHOWN = reprlib.Repr()
_SHOWN.maxlevel = 2
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = _SHOWN.maxset = 8
_SHOWN.maxstring = _SHOWN.maxother = 80
_SHOWN_CHARS = 240


def shown(value: object) -> str:
    """``repr(value)``, cut short: at most 8 items of a list or mapping, 2 levels deep, 80
    characters of a string, 240 in all."""
    text = _SHOWN.repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS - 3] + "..."


#: what YAML's safe loader builds that holds other values (``!!omap`` and ``!!pairs`` are lists
#: of tuples, and a tuple may hold an alias like any list)
_CONTAINERS = (list, tuple, dict)


def expansion_problem(data: object, limit: int = MAX_EXPANDED_VALUES) -> str | None:
    """What is wrong with ``data`` (loaded YAML: lists, tuples, mappings and scalars) as data to walk:
    it holds itself, or more than ``limit`` values with every repeated part counted each time
    it is reached; None when neither. A part that several places share is counted once
    (by identity) and reused, so this costs the distinct containers, not the expansion."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()         # begun, not yet summed: reaching one again is a cycle
    stack: list[tuple[object, bool]] = [(data, False)]
    while stack:
        node, summing = stack.pop()
        key = id(node)
        items = node.values() if isinstance(node, dict) else node
        if summing:
            total = 1 + sum(sizes[id(item)] if isinstance(item, _CONTAINERS) else 1 for item in items)
            if total > limit:
                return (f"it expands to more than {limit:,} values (YAML aliases repeat a part of it that many "
                        "times); write it out without them")
            sizes[key] = total
            open_.discard(key)
            continue
        if not isinstance(node, _CONTAINERS) or key in sizes:
            continue
        if key in open_:
            return "it holds itself (a YAML alias inside the part it names)"
        open_.add(key)
        stack.append((node, True))
        stack.extend((item, False) for item in items if isinstance(item, _CONTAINERS) and id(item) not in sizes)
    return None
