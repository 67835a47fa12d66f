"""TrainState: everything a bit-exact resume needs, captured as tensors plus typed JSON.

Order matters. Capture: components first (a loader's state_dict() may draw from the
global RNG), then named generators, then the global RNGs last, so the stored RNG state
is the one training continues from. Restore: the same order, RNGs last, so nothing a
load_state_dict() does can disturb them afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lastgood.state import loaders, rng
from lastgood.state.ddp_buckets import establish as establish_ddp_buckets
from lastgood.state.ddp_buckets import layout as ddp_buckets_layout
from lastgood.state.codec import Encoder, decode
from lastgood.state.dtypes import ST_TO_TORCH
from lastgood.errors import LastgoodError

STATE_VERSION = 1
STATE_VERSION_REPLICAS = 2  # some replicated tensors are in other ranks' files (replicas.py)
_RESERVED = {"extra", "rng", "step"}


def _unwrap(module: nn.Module) -> nn.Module:
    # DDP adds a "module." prefix to every key; store the plain model's names.
    inner = getattr(module, "module", None)
    if isinstance(module, nn.parallel.DistributedDataParallel) and isinstance(inner, nn.Module):
        return inner
    return module


@dataclass
class Captured:
    json_state: dict
    tensors: dict  # name -> torch.Tensor | numpy.ndarray


class TrainState:
    """Named training state. Anything with state_dict()/load_state_dict() works: modules,
    optimizers, LR schedulers, StatefulDataLoader, a DataLoader over a
    ResumableDistributedSampler; `torch.Generator`s are saved by name; `extra` is a dict of
    JSON values restored in place (keep a reference and update it, e.g. the epoch)."""

    def __init__(self, extra: dict | None = None, **components) -> None:
        for name, obj in components.items():
            if name in _RESERVED or "." in name or not name.isidentifier():
                raise ValueError(f"invalid component name {name!r}")
            if not (isinstance(obj, torch.Generator) or loaders.is_loader(obj)
                    or (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"))):
                raise TypeError(f"component {name!r} ({type(obj).__name__}) has no state_dict()/load_state_dict()")
        if extra is not None and not isinstance(extra, dict):
            raise TypeError("extra must be a dict of JSON values")
        self.components = dict(components)
        self.extra = {} if extra is None else extra
        self._adapters = {n: loaders.adapt(o) for n, o in components.items() if loaders.is_loader(o)}
        # FSDP2 (DTensor) modules, and for each optimizer over one of them, that module:
        # their state goes through torch.distributed.checkpoint.state_dict, shard by shard
        from lastgood.state.sharding import is_sharded  # torch.distributed.checkpoint, loaded when needed

        self._sharded = {n for n, o in components.items() if isinstance(o, nn.Module) and is_sharded(_unwrap(o))}
        self._owner: dict[str, nn.Module] = {}
        for n, o in components.items():
            if isinstance(o, torch.optim.Optimizer):
                first = next((p for g in o.param_groups for p in g["params"]), None)
                for m in self._sharded:
                    if first is not None and any(p is first for p in _unwrap(components[m]).parameters()):
                        self._owner[n] = _unwrap(components[m])

    # ------------------------------------------------------------------ naming
    def _param_names(self) -> dict[int, str]:
        names = {}
        for cname, obj in self.components.items():
            if isinstance(obj, nn.Module):
                for pname, p in _unwrap(obj).named_parameters():
                    names.setdefault(id(p), f"{cname}.{pname}")
        return names

    @staticmethod
    def _optimizer_renamer(opt: torch.optim.Optimizer, cname: str, pnames: dict[int, str]):
        by_index = [pnames.get(id(p)) for g in opt.param_groups for p in g["params"]]

        def rename(path: list[str]) -> list[str]:
            # optimizer.state.<index>.exp_avg -> optimizer.state.<param name>.exp_avg
            if len(path) >= 3 and path[1] == "state" and path[2].isdigit():
                i = int(path[2])
                if i < len(by_index) and by_index[i]:
                    return [cname, "state", by_index[i], *path[3:]]
            return path

        return rename, by_index

    def _kind(self, name: str) -> str:
        obj = self.components[name]
        if name in self._adapters:
            return "loader"
        if isinstance(obj, torch.Generator):
            return "generator"
        if name in self._sharded:
            return "sharded_module"
        if name in self._owner:
            return "sharded_optimizer"
        if isinstance(obj, nn.Module):
            return "module"
        if isinstance(obj, torch.optim.Optimizer):
            return "optimizer"
        return "stateful"

    def _order(self) -> list[str]:
        """Loaders and generators after the model, optimizer and schedulers (see above)."""
        return sorted(self.components, key=lambda n: self._kind(n) in ("loader", "generator"))

    # ------------------------------------------------------------------ capture
    def capture(self, step: int, rank: int, world_size: int, ddp_buckets: bool = True) -> Captured:
        """`ddp_buckets`: record each DDP module's gradient-bucket layout, for apply() to
        resume in (ddp_buckets.py)."""
        enc = Encoder()
        pnames = self._param_names()
        comps, param_index = {}, {}
        for name in self._order():
            obj, kind = self.components[name], self._kind(name)
            rename = None
            if kind == "loader":
                sd = self._adapters[name].state_dict()
            elif kind == "generator":
                sd = obj.get_state()
            elif kind == "module":
                sd = _unwrap(obj).state_dict()
            elif kind == "sharded_module":
                from torch.distributed.checkpoint.state_dict import get_model_state_dict
                sd = get_model_state_dict(_unwrap(obj))  # DTensors: each rank stores its shards
            elif kind == "sharded_optimizer":
                from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
                sd = get_optimizer_state_dict(self._owner[name], obj)  # keyed by parameter name
            else:
                sd = obj.state_dict()
                if kind == "optimizer":
                    rename, param_index[name] = self._optimizer_renamer(obj, name, pnames)
            comps[name] = {"kind": kind, "state": enc.encode(sd, [name], rename)}
            if kind == "module" and ddp_buckets and isinstance(obj, nn.parallel.DistributedDataParallel):
                buckets = ddp_buckets_layout(obj)  # a due rebuild is done here, on every rank
                if buckets is not None:
                    comps[name]["ddp_buckets"] = buckets
        extra = enc.encode(self.extra, ["extra"])
        rng_state = enc.encode(rng.capture(), ["rng"])  # last: see the module docstring
        return Captured({"version": STATE_VERSION, "step": step, "rank": rank, "world_size": world_size,
                         "components": comps, "extra": extra, "rng": rng_state,
                         "param_index": param_index}, enc.tensors)

    # ------------------------------------------------------------------ restore
    def optimizer_tensors(self, saved: dict) -> dict:
        """The tensors of every plain optimizer's current state, under the names a capture
        gives them (none for an optimizer that has not stepped yet), for restore to copy
        into. Only optimizers whose saved param groups (`saved`: the checkpoint's
        components) have the sizes of the live ones: load_state_dict refuses anything else,
        and must do so before a single moment was overwritten."""
        enc = Encoder()
        pnames = self._param_names()
        for name in self._order():
            if self._kind(name) != "optimizer":
                continue
            opt = self.components[name]
            if not _groups_match(((saved.get(name) or {}).get("state") or {}).get("param_groups"), opt):
                continue
            rename, _ = self._optimizer_renamer(opt, name, pnames)
            enc.encode(opt.state_dict(), [name], rename)
        return {n: t for n, t in enc.tensors.items() if isinstance(t, torch.Tensor)}

    def module_tensor_names(self) -> set[str]:
        """Stored names of the plain modules' parameters and buffers: load_state_dict copies
        those into the module. Anything else a module stores (extra state) may be kept as
        given, so restore hands it a tensor of its own."""
        return set(self.module_tensors())

    def module_tensors(self) -> dict[str, torch.Tensor]:
        """The plain modules' parameters and buffers under their stored names (detached
        views of the live tensors), for restore to copy into before load_state_dict."""
        out = {}
        for name, obj in self.components.items():
            if self._kind(name) == "module":
                m = _unwrap(obj)
                out.update((f"{name}.{n}", t.detach()) for n, t in m.named_parameters())
                out.update((f"{name}.{n}", t.detach()) for n, t in m.named_buffers())
        return out

    def sharded_live(self) -> dict:
        """Component -> its live state dict, for each FSDP2 module and each optimizer over
        one: the DTensors a restore at another world size plans its reads against
        (readplan.py). An optimizer's moments are planned against its parameters, whose
        placements they mirror: the optimizer itself is not touched. Giving a fresh one its
        moments takes an optimizer step, which may issue collectives (a hang while another
        rank has already failed) and must not happen before the ranks agree to apply: a
        restore that ends in NoUsableCheckpoint leaves the optimizer as it found it. A
        stored moment of another shape than its parameter (a factored one) is not planned
        (readplan.fetch then reads whole files)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        out = {}
        for name in self._order():
            kind = self._kind(name)
            if kind == "sharded_module":
                out[name] = get_model_state_dict(_unwrap(self.components[name]))
            elif kind == "sharded_optimizer":
                params = get_model_state_dict(self._owner[name])  # keyed by parameter name, as the optimizer's
                out[name] = {"state": {fqn: _Moments(p) for fqn, p in params.items()}}
        return out

    def aliases(self, buf: torch.Tensor) -> bool:
        """Does any module or optimizer tensor share memory with `buf` (a CPU byte buffer)?"""
        lo = buf.data_ptr()
        hi = lo + buf.numel()
        for t in self._live_tensors():
            if t.device.type != "cpu" or t.layout != torch.strided:
                continue
            storage = t.untyped_storage()
            start = storage.data_ptr()
            if start < hi and lo < start + storage.nbytes():
                return True
        return False

    def _live_tensors(self):
        for name, obj in self.components.items():
            if isinstance(obj, nn.Module):
                yield from (_local(t) for t in _unwrap(obj).parameters())
                yield from (_local(t) for t in _unwrap(obj).buffers())
                for m in _unwrap(obj).modules():  # tensors kept as plain attributes
                    yield from (_local(v) for v in vars(m).values() if isinstance(v, torch.Tensor))
            elif isinstance(obj, torch.optim.Optimizer):
                for per_param in obj.state.values():
                    yield from (_local(v) for v in per_param.values() if isinstance(v, torch.Tensor))

    def apply(self, json_state: dict, tensor, array, shards=None, reseed: int | None = None,
              world_changed: bool = False, ddp_buckets: bool = True) -> None:
        """Load captured state in place; `tensor(name, device)` / `array(name)` resolve refs.

        `shards` (a sharding.ShardIndex) holds every stored DTensor shard needed to fill this
        rank's current shards. `reseed`: this rank did not exist when the checkpoint was
        saved; its RNGs are seeded from it instead of restored (see docs/training.md). With
        `world_changed`, loaders restore their global data position. `ddp_buckets`: a DDP
        module's Reducer is built anew in the gradient-bucket layout saved with it."""
        if json_state.get("version") not in (STATE_VERSION, STATE_VERSION_REPLICAS):
            raise LastgoodError(f"unsupported state version {json_state.get('version')!r}")
        saved = json_state["components"]
        missing = sorted(set(self.components) - set(saved))
        unknown = sorted(set(saved) - set(self.components))
        if missing or unknown:
            raise LastgoodError(f"TrainState does not match the checkpoint: not in checkpoint {missing}, "
                                f"not in this TrainState {unknown}")
        rng_state = decode(json_state["rng"], tensor, array)
        if reseed is None:
            rng.check(rng_state)  # before anything is loaded: a mismatch must not leave a half-restored rank
        if (self._sharded or self._owner) and shards is None:
            raise LastgoodError("sharded state needs the stored shards to restore from")
        for name in self._order():
            obj, kind = self.components[name], self._kind(name)
            if saved[name]["kind"] != kind:
                raise LastgoodError(f"component {name!r} was a {saved[name]['kind']} at save time, is a {kind} now")
            sd = decode(saved[name]["state"], tensor, array)
            if kind == "loader":
                if world_changed and not isinstance(self._adapters[name], loaders.PlainLoaderAdapter):
                    raise LastgoodError(
                        f"loader {name!r}: restoring at another world size needs the data position as a global "
                        f"sample position; use a DataLoader over lastgood.ResumableDistributedSampler")
                self._adapters[name].load_state_dict(sd)
            elif kind == "generator":
                if reseed is None:
                    obj.set_state(sd)
                else:
                    obj.manual_seed(reseed)
            elif kind == "module":
                _unwrap(obj).load_state_dict(sd, strict=True)
                if ddp_buckets and isinstance(obj, nn.parallel.DistributedDataParallel):
                    establish_ddp_buckets(obj, saved[name].get("ddp_buckets"))
            elif kind == "sharded_module":
                from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

                from lastgood.state.sharding import fill_tree

                module = _unwrap(obj)
                set_model_state_dict(module, fill_tree(sd, get_model_state_dict(module), shards))
            elif kind == "sharded_optimizer":
                from torch.distributed.checkpoint.state_dict import (_init_optim_state, get_optimizer_state_dict,
                                                                     set_optimizer_state_dict)

                from lastgood.state.sharding import fill_tree

                _init_optim_state(obj)  # a fresh optimizer has no moments to fill yet
                live = get_optimizer_state_dict(self._owner[name], obj)
                set_optimizer_state_dict(self._owner[name], obj, fill_tree(sd, live, shards))
            else:
                obj.load_state_dict(sd)
        restored_extra = decode(json_state["extra"], tensor, array)
        self.extra.clear()
        self.extra.update(restored_extra)
        if reseed is None:
            rng.restore(rng_state)
        else:
            rng.seed_all(reseed)


def _groups_match(saved_groups, opt: torch.optim.Optimizer) -> bool:
    """Do the saved (encoded) param groups have the live optimizer's group sizes?"""
    if not isinstance(saved_groups, list) or not all(isinstance(g, dict) for g in saved_groups):
        return False
    return [len(g.get("params") or ()) for g in saved_groups] == [len(g["params"]) for g in opt.param_groups]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def fits(dst: torch.Tensor, spec: dict, device: str | None) -> bool:
    """Can the stored tensor `spec` (on `device` at save time) be copied into `dst` as it is?"""
    return (dst.dtype == ST_TO_TORCH[spec["dtype"]] and tuple(dst.shape) == tuple(spec["shape"])
            and dst.device == torch.device(device or "cpu") and _local(dst) is dst)


class _Moments(dict):
    """The live target of one parameter's optimizer state in a read plan: every key is the
    parameter itself (the moments have its shape and placements; readplan.fetch checks
    the shape), so planning needs no optimizer step (TrainState.sharded_live)."""

    def __init__(self, param) -> None:
        super().__init__()
        self.param = param

    def get(self, key, default=None):
        return self.param
