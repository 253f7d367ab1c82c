"""A cache as plain data: :func:`encode` turns a cache's object graph into JSON and tensors, :func:`decode` back.

Generic: a cache is described by the attributes of its objects (``vars()``, or ``__getstate__``
where a class defines one), so every cache and layer class, present or future, is saved with
no code of its own. The description is ``{"objects": [...], "root": value}``; each object is
``{"class": name, "state": {attribute: value}}`` and each value a JSON scalar, a list, or a
tagged value: ``{"$tensor": key}``, ``{"$object": index}`` (so shared objects and cycles stay
shared), ``{"$tuple": [...]}``, ``{"$dict": [[key, value], ...]}``, ``{"$dtype": "float16"}``,
``{"$device": "cuda:0"}``, ``{"$size": [...]}``, ``{"$float": "nan"}``, ``{"$method": [object,
name]}``, ``{"$function": name}``, ``{"$class": name}``, ``{"$subclass": {...}}`` (a quanto tensor).

Safe: decoding builds only the classes of the registry (kvgen's ``Cache`` and ``CacheLayer``
subclasses, the helper classes below, those added with :func:`register_persistable`), calls
only their own methods, sets only plain attribute names, and builds tensor subclasses only
from optimum-quanto. Anything else in a description raises :class:`DescriptionError`.

A few helper classes hold more than data and have a policy (see :class:`_Policies`, registered by their
modules with :func:`register_policy`): scratch
buffers, streams, events and the offload schedule are saved as fresh values, so a decoded
offloaded cache starts with every layer offloaded; quantization backends are saved as their
constructor arguments.
"""

from __future__ import annotations

import math
import types
from typing import Any, Callable

import torch

from kvgen.cache.base import Cache, CacheLayer

_TENSOR_SUBCLASS_MODULES = ("optimum.quanto.",)
_EXTRA_CLASSES: dict[str, type] = {}
_EXTRA_FUNCTIONS: dict[str, Callable] = {}


class DescriptionError(ValueError):
    """A cache description that names something kvgen does not rebuild, or that is malformed."""


def register_persistable(obj):
    """Allow cache files to hold instances of the class ``obj``, or to name the function ``obj``; a decorator.

    kvgen's own ``Cache`` and ``CacheLayer`` subclasses need no registration: this is for the
    helper objects a cache keeps, and module-level functions it keeps (e.g. as layer factories).

    Example:
        >>> from kvgen.cache.codec import register_persistable
        >>> @register_persistable
        ... class ConvState:  # a helper object that some layer keeps
        ...     pass
    """
    if isinstance(obj, type):
        _EXTRA_CLASSES[obj.__name__] = obj
    elif isinstance(obj, types.FunctionType) and obj.__name__ != "<lambda>":
        _EXTRA_FUNCTIONS[obj.__name__] = obj
    else:
        raise TypeError(f"register_persistable takes a class or a module-level function, got {obj!r}")
    return obj


# -- what may be named ---------------------------------------------------------------------------------

def _subclasses(cls: type) -> list[type]:
    out, todo = [], [cls]
    while todo:
        klass = todo.pop()
        out.append(klass)
        todo.extend(klass.__subclasses__())
    return out


def registry() -> dict[str, type]:
    """Class name -> class, for every class a description may name: every ``Cache`` and ``CacheLayer`` subclass
    of kvgen's (``kvgen.cache`` imports every module that defines one) and the registered helper classes."""
    found = [c for base in (Cache, CacheLayer) for c in _subclasses(base) if c.__module__.startswith("kvgen.")]
    out: dict[str, type] = {}
    for cls in [*found, *_EXTRA_CLASSES.values()]:
        if out.setdefault(cls.__name__, cls) is not cls:
            raise RuntimeError(f"two persistable classes are named {cls.__name__!r}: {out[cls.__name__]} and {cls}")
    return out


def _functions() -> dict[str, Callable]:
    return dict(_EXTRA_FUNCTIONS)


def _tensor_classes() -> dict[str, type]:
    return {f"{c.__module__}.{c.__qualname__}": c for c in _subclasses(torch.Tensor)
            if c.__module__.startswith(_TENSOR_SUBCLASS_MODULES)}


#: the policies of :class:`_Policies`, registered by the modules of the classes they are for
_POLICY_TABLES: dict[str, dict[type, Any]] = {
    "transient": {Cache: ("_model_ref", "model_fingerprint")},  # (recorded by persist.py on their own)
    "reset": {}, "rebuilt": {}, "constructed": {}, "before_save": {}, "inner_device": {},
}


def register_policy(cls: type, **policies) -> None:
    """What saving ``cls`` needs beyond its attributes (see :class:`_Policies` for each kind); its module calls
    this on import, with :func:`register_persistable` for a helper class.

    Example:
        >>> register_policy(Workspace, reset={"_buffers": {}, "generation": 0})   # doctest: +SKIP
    """
    for kind, value in policies.items():
        if kind not in _POLICY_TABLES:
            raise TypeError(f"no policy {kind!r}: one of {sorted(_POLICY_TABLES)}")
        _POLICY_TABLES[kind][cls] = value


class _Policies:
    """What a few helper classes need beyond "save the attributes", keyed by class (subclasses included).

    * ``transient``: attributes not saved (after decoding they read the class default);
    * ``reset``: attributes saved as fixed values (scratch buffers, streams, events, the offload
      schedule): a decoded offloaded cache has every layer on its offload device;
    * ``rebuilt``: attributes not saved, recomputed from the decoded object;
    * ``constructed``: objects saved as constructor arguments (they hold library objects);
    * ``before_save``: called on each such object before encoding (offloaded copies in flight land);
    * ``inner_device``: where :func:`place` puts an object's ``inner`` attribute (an offloaded layer's: its
      offload device), from the object.
    """

    def __init__(self):
        for kind, table in _POLICY_TABLES.items():
            setattr(self, kind, dict(table))

    @staticmethod
    def lookup(table: dict, cls: type):
        """The entry of ``cls``'s nearest class in ``table`` (``None``: none)."""
        return next((table[klass] for klass in cls.__mro__ if klass in table), None)

    @staticmethod
    def merged(table: dict, cls: type) -> dict:
        """The entries of all of ``cls``'s classes in ``table``, merged (tuples become dict keys)."""
        out: dict = {}
        for klass in reversed(cls.__mro__):
            entry = table.get(klass, {})
            out.update(dict.fromkeys(entry) if isinstance(entry, tuple) else entry)
        return out


# -- encoding ------------------------------------------------------------------------------------------

def encode(root) -> tuple[dict, dict[str, torch.Tensor], dict[str, dict]]:
    """``(description, tensors, records)`` of the object graph under ``root`` (a cache).

    ``tensors`` maps keys to contiguous CPU tensors sharing no memory (as safetensors needs);
    ``records`` gives each key's dtype, shape and where the tensor lives (``cache.layers[3]._k``).
    Raises ``TypeError`` naming the attribute when the graph holds something that could not
    be decoded (an unregistered class, a lambda, ...).

    Example:
        >>> from kvgen import DynamicCache
        >>> description, tensors, records = encode(DynamicCache())
        >>> description["objects"][0]["class"], tensors
        ('DynamicCache', {})
    """
    encoder = _Encoder()
    for obj in _reachable(root, encoder.registry):
        hook = _Policies.lookup(encoder.policies.before_save, type(obj))
        if hook is not None:
            hook(obj)
    top = encoder.value(root, "cache")
    return {"objects": encoder.objects, "root": top}, encoder.tensors, encoder.records


def _reachable(root, classes: dict[str, type]) -> list:
    """Every object of a registered class in the graph under ``root``."""
    seen, out, todo = set(), [], [root]
    while todo:
        v = todo.pop()
        if isinstance(v, (list, tuple)):
            todo.extend(v)
        elif isinstance(v, dict):
            todo.extend(v.values())
        elif classes.get(type(v).__name__) is type(v) and id(v) not in seen:
            seen.add(id(v))
            out.append(v)
            todo.extend(vars(v).values())
    return out


def _state_of(obj) -> dict:
    getstate = getattr(type(obj), "__getstate__", None)
    state = obj.__getstate__() if getstate not in (None, object.__getstate__) else vars(obj)
    if state is None:
        return {}
    if not isinstance(state, dict):
        raise TypeError(f"{type(obj).__name__}.__getstate__ returns a {type(state).__name__}; cache files need a dict")
    return dict(state)


class _Encoder:
    def __init__(self):
        self.registry, self.policies = registry(), _Policies()
        self.functions = {id(fn): name for name, fn in _functions().items()}
        self.objects: list[dict] = []
        self.object_index: dict[int, int] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        self.records: dict[str, dict] = {}
        self.tensor_keys: dict[int, str] = {}
        self.storages: set[int] = set()

    def value(self, v, path: str):
        if v is None or isinstance(v, (bool, int, str)):
            return v
        if isinstance(v, float):
            return v if math.isfinite(v) else {"$float": repr(v)}
        if isinstance(v, torch.Tensor):
            return self.tensor(v, path)
        if isinstance(v, torch.dtype):
            return {"$dtype": str(v).removeprefix("torch.")}
        if isinstance(v, torch.device):
            return {"$device": str(v)}
        if isinstance(v, torch.Size):
            return {"$size": list(v)}
        if isinstance(v, list):
            return [self.value(x, f"{path}[{i}]") for i, x in enumerate(v)]
        if isinstance(v, tuple):
            return {"$tuple": [self.value(x, f"{path}[{i}]") for i, x in enumerate(v)]}
        if isinstance(v, dict):
            return {"$dict": [[self.value(k, f"{path}.key"), self.value(x, f"{path}[{k!r}]")] for k, x in v.items()]}
        if isinstance(v, types.MethodType):
            owner = v.__self__
            if isinstance(owner, type) or getattr(type(owner), v.__name__, None) is not v.__func__:
                raise TypeError(f"cannot save {path}: {v!r} is not a plain method of a cache object")
            return {"$method": [self.value(owner, f"{path}.__self__"), v.__name__]}
        if isinstance(v, types.FunctionType):
            if id(v) not in self.functions:
                raise TypeError(f"cannot save {path}: the function {v.__qualname__} (a lambda?) cannot be named in a "
                                "file; use a method, or a module-level function passed to register_persistable")
            return {"$function": self.functions[id(v)]}
        if isinstance(v, type):
            if self.registry.get(v.__name__) is not v:
                raise TypeError(f"cannot save {path}: the class {v.__qualname__} is not registered")
            return {"$class": v.__name__}
        return self.obj(v, path)

    def obj(self, obj, path: str) -> dict:
        if id(obj) in self.object_index:
            return {"$object": self.object_index[id(obj)]}
        cls = type(obj)
        if self.registry.get(cls.__name__) is not cls:
            raise TypeError(
                f"cannot save {path}: a {cls.__module__}.{cls.__qualname__} is not a class kvgen cache files may "
                "hold. kvgen's Cache and CacheLayer subclasses are allowed; register a helper class with "
                "kvgen.cache.register_persistable"
            )
        index = self.object_index[id(obj)] = len(self.objects)
        entry: dict[str, Any] = {"class": cls.__name__}
        self.objects.append(entry)
        p = self.policies
        build = p.lookup(p.constructed, cls)
        if build is not None:
            entry["args"] = [self.value(a, f"{path}(argument {i})") for i, a in enumerate(build(obj))]
            return {"$object": index}
        state = _state_of(obj)
        for attr in (*p.merged(p.transient, cls), *p.merged(p.rebuilt, cls)):
            state.pop(attr, None)
        for attr, fixed in p.merged(p.reset, cls).items():
            if attr in state:
                state[attr] = fixed
        entry["state"] = {attr: self.value(v, f"{path}.{attr}") for attr, v in state.items()}
        return {"$object": index}

    def tensor(self, t: torch.Tensor, path: str) -> dict:
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            return self.subclass(t, path)
        if id(t) in self.tensor_keys:
            return {"$tensor": self.tensor_keys[id(t)]}
        key = self.tensor_keys[id(t)] = f"t{len(self.tensors)}"
        data = t.detach().to("cpu").contiguous()
        if data.untyped_storage().data_ptr() in self.storages:  # views of one buffer: safetensors wants copies
            data = data.clone()
        self.storages.add(data.untyped_storage().data_ptr())
        self.tensors[key] = data
        self.records[key] = {"dtype": str(data.dtype).removeprefix("torch."), "shape": list(data.shape), "path": path}
        return {"$tensor": key}

    def subclass(self, t: torch.Tensor, path: str) -> dict:
        name = f"{type(t).__module__}.{type(t).__qualname__}"
        if not name.startswith(_TENSOR_SUBCLASS_MODULES) or not hasattr(t, "__tensor_flatten__"):
            raise TypeError(f"cannot save {path}: tensors of type {name} are not supported "
                            f"(only torch.Tensor and the tensor types of {', '.join(_TENSOR_SUBCLASS_MODULES)})")
        names, meta = t.__tensor_flatten__()
        return {"$subclass": {"class": name, "inner": {n: self.tensor(getattr(t, n), f"{path}.{n}") for n in names},
                              "meta": self.value(meta, f"{path}.meta"), "size": list(t.size()),
                              "stride": list(t.stride())}}


# -- decoding ------------------------------------------------------------------------------------------

def decode(description: dict, tensors: dict[str, torch.Tensor]):
    """The object graph that :func:`encode` described, built from ``description`` and ``tensors`` (its keys).

    Raises :class:`DescriptionError` for names outside the registry and malformed entries
    (other exceptions, e.g. ``KeyError``, for a description of the wrong shape), and
    ``ImportError`` when a quantization backend's library is missing.

    Example:
        >>> from kvgen import DynamicCache
        >>> cache = decode(*encode(DynamicCache())[:2])
        >>> type(cache).__name__
        'DynamicCache'
    """
    return _Decoder(tensors).graph(description)


def _attribute_name(name) -> bool:
    return isinstance(name, str) and name.isidentifier() and not name.startswith("__")


class _Decoder:
    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors, self.registry, self.functions, self.policies = tensors, registry(), _functions(), _Policies()
        self.instances: list = []

    def _class(self, name) -> type:
        cls = self.registry.get(name) if isinstance(name, str) else None
        if cls is None:
            raise DescriptionError(
                f"it names the class {name!r}, which is not a kvgen cache class this version knows "
                f"(known: {', '.join(sorted(self.registry))}). Was it written by a newer kvgen, or edited?"
            )
        return cls

    def graph(self, description: dict):
        entries = description["objects"]
        if not isinstance(entries, list):
            raise DescriptionError("its objects are not a list")
        p = self.policies
        for entry in entries:  # every instance first, so references (and cycles) resolve
            cls = self._class(entry["class"])
            if ("args" in entry) != (p.lookup(p.constructed, cls) is not None):
                raise DescriptionError(f"the entry of a {cls.__name__} has the wrong form")
            self.instances.append(None if "args" in entry else cls.__new__(cls))
        for i, entry in enumerate(entries):
            if "args" in entry:  # (arguments are plain values)
                self.instances[i] = self._class(entry["class"])(*[self.value(a) for a in entry["args"]])
        for obj, entry in zip(self.instances, entries):
            if "args" not in entry:
                self._set_state(obj, entry["state"])
        for obj in self.instances:
            for attr, build in p.merged(p.rebuilt, type(obj)).items():
                setattr(obj, attr, build(obj))
        return self.value(description["root"])

    def _set_state(self, obj, state) -> None:
        if not isinstance(state, dict) or not all(_attribute_name(k) for k in state):
            raise DescriptionError(f"invalid attribute names in the state of a {type(obj).__name__}")
        state = {k: self.value(v) for k, v in state.items()}
        if getattr(type(obj), "__setstate__", None) is not None:
            obj.__setstate__(state)
        else:
            obj.__dict__.update(state)

    def value(self, v):
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, list):
            return [self.value(x) for x in v]
        if not isinstance(v, dict) or len(v) != 1:
            raise DescriptionError(f"unexpected value {str(v)[:80]}")
        (tag, x), = v.items()
        decode_tag = self._TAGS.get(tag)
        if decode_tag is None:
            raise DescriptionError(f"unknown value tag {tag!r}")
        return decode_tag(self, x)

    def _object(self, x):
        if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < len(self.instances):
            raise DescriptionError(f"it refers to object {x!r}, which the file does not hold")
        return self.instances[x]

    def _tensor(self, x):
        if not isinstance(x, str) or x not in self.tensors:
            raise DescriptionError(f"it refers to tensor {x!r}, which the file does not hold")
        return self.tensors[x]

    def _dict(self, x):
        out = {}
        for k, e in x:
            key = self.value(k)
            if isinstance(key, (list, dict, torch.Tensor)):
                raise DescriptionError("a dict key is not hashable")
            out[key] = self.value(e)
        return out

    def _float(self, x):
        if x not in ("nan", "inf", "-inf"):
            raise DescriptionError(f"invalid float {x!r}")
        return float(x)

    def _dtype(self, x):
        dtype = getattr(torch, x, None) if isinstance(x, str) else None
        if not isinstance(dtype, torch.dtype):
            raise DescriptionError(f"unknown dtype {x!r}")
        return dtype

    def _method(self, x):
        owner, name = self.value(x[0]), x[1]
        if not (_attribute_name(name) and isinstance(getattr(type(owner), name, None), types.FunctionType)):
            raise DescriptionError(f"{name!r} is not a method of {type(owner).__name__}")
        return getattr(owner, name)

    def _function(self, x):
        if not isinstance(x, str) or x not in self.functions:
            raise DescriptionError(f"unknown function {x!r}")
        return self.functions[x]

    def _subclass(self, x: dict) -> torch.Tensor:
        name = x["class"]
        if not isinstance(name, str) or not name.startswith(_TENSOR_SUBCLASS_MODULES):
            raise DescriptionError(f"tensors of type {name!r} are not loaded")
        classes = _tensor_classes()
        if name not in classes and name.startswith("optimum.quanto."):
            import optimum.quanto  # noqa: F401  (defines its tensor types; ImportError says what to install)

            classes = _tensor_classes()
        if name not in classes:
            raise DescriptionError(f"unknown tensor type {name!r}")
        inner = {n: self.value(t) for n, t in x["inner"].items()}
        if not all(_attribute_name(n) and isinstance(t, torch.Tensor) for n, t in inner.items()):
            raise DescriptionError(f"a malformed {name}")
        return classes[name].__tensor_unflatten__(inner, self.value(x["meta"]), torch.Size(x["size"]),
                                                  tuple(x["stride"]))

    _TAGS = {
        "$object": _object, "$tensor": _tensor, "$dict": _dict, "$float": _float, "$dtype": _dtype,
        "$method": _method, "$function": _function, "$subclass": _subclass,
        "$tuple": lambda self, x: tuple(self.value(e) for e in x),
        "$device": lambda self, x: torch.device(x),
        "$size": lambda self, x: torch.Size([int(e) for e in x]),
        "$class": lambda self, x: self._class(x),
    }


# -- placement -----------------------------------------------------------------------------------------

def place(root, device: torch.device) -> None:
    """Move every tensor under ``root`` to ``device``; what an ``OffloadedLayer`` wraps to its offload device."""
    classes, seen, inner = registry(), set(), _POLICY_TABLES["inner_device"]

    def move(v, target):
        if isinstance(v, torch.Tensor):
            return v.to(target)
        if isinstance(v, list):
            v[:] = [move(x, target) for x in v]
        elif isinstance(v, tuple):
            return tuple(move(x, target) for x in v)
        elif isinstance(v, dict):
            for k in list(v):
                v[k] = move(v[k], target)
        elif classes.get(type(v).__name__) is type(v) and id(v) not in seen:
            seen.add(id(v))
            rule = _Policies.lookup(inner, type(v))
            offload = rule(v) if rule is not None else None
            for attr, x in list(vars(v).items()):
                vars(v)[attr] = move(x, offload if attr == "inner" and offload is not None else target)
        return v

    move(root, device)
