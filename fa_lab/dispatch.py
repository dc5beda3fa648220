"""One table from a checked call to the code that runs it; no family is named here.

``TABLE`` maps (kernel family, backend) to an ``Entry``: the entry point and what it can
do, built from the registered families (``fa_lab.kernels.FAMILIES``). Everything dispatch
knows of a family is on its ``fa_lab.capabilities.Family``: upstream's routing rule
(``fa_lab.routing.Rule``), the dtypes, head dims, features and policy values of each
implementation, and its notes. ``plan`` is the one place that decides: it routes the
checked call once (``route``), resolves its policy once for that family, picks the backend
and checks every capability before any work, into an immutable ``Plan``; ``run`` executes
a plan without deciding again. fa_lab reaches the Triton kernels through here only.

Backends: ``emulator`` the exact PyTorch model (any device); ``triton`` the faithful
Triton ports on GPU tensors; ``interpret`` the same ports on CPU tensors through Triton's
interpreter; ``fast`` the fast Triton kernels (their own tiling, the same policy
semantics; compiled on GPU tensors, interpreted on CPU tensors); ``flydsl`` upstream's
own kernel on an MI355X (``fa_lab.flydsl``); ``auto`` the faithful ports on GPU tensors
where they cover the call, else the model.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
import warnings
from dataclasses import dataclass

import torch

from fa_lab import capabilities, kernels, routing, varlen
from fa_lab.capabilities import DTYPE_NAMES, Caps, Family
from fa_lab.checks import caller_stacklevel
from fa_lab.kernels import FAMILIES
from fa_lab.policies import Policy, Request, as_policy, get
from fa_lab.upstream import Version

BACKENDS = ("auto", "emulator", "triton", "interpret", "fast", "flydsl")


#: The implementation each backend runs (``fa_lab.capabilities``).
IMPLEMENTATION = {"emulator": "model", "triton": "faithful", "interpret": "faithful",
                  "fast": "fast"}
#: The tensor device type each backend needs: compiled on GPU tensors, the interpreter
#: takes CPU tensors, "fast" and the model go by the tensors' device.
DEVICES = {"emulator": None, "triton": "cuda", "interpret": "cpu", "fast": None}


@dataclass(frozen=True)
class Entry:
    """What one (family, backend) runs: the family's implementation (its module is
    imported on first use: Triton is optional and slow to import), the tensor device type
    it needs (None: any), its capabilities (``Caps``) and whether it is a Triton kernel."""

    family: str
    backend: str
    impl: str
    caps: Caps
    device: str | None = None
    triton: bool = False

    def load(self):
        """The implementation's module (its ``forward``)."""
        return kernels.module(self.family, self.impl)

    @property
    def has_varlen(self) -> bool:
        return FAMILIES[self.family].implementations[self.impl].varlen is not None

    def varlen_load(self):
        """The module with the implementation's one-launch ``forward_varlen``."""
        name = FAMILIES[self.family].implementations[self.impl].varlen
        return importlib.import_module(f"{kernels.PACKAGES[self.family]}.{name}")


def _entries():
    table = {}
    for backend, impl in IMPLEMENTATION.items():
        for name, fam in FAMILIES.items():
            if impl in fam.implementations:
                table[(name, backend)] = Entry(name, backend, impl, fam.caps(impl), DEVICES[backend],
                                               backend != "emulator")
    return table


#: (family, backend) -> Entry: the one table, built from the registered families.
TABLE: dict[tuple[str, str], Entry] = {}
#: The families ``flash_attn_func`` routes to (``kernel=`` takes these).
ROUTED: tuple[str, ...] = ()
#: The routed families that model upstream FlyDSL's kernels (upstream's routing picks among
#: them by their rules); the others are fa_lab's own and run where a policy or ``kernel=``
#: asks for them.
UPSTREAM: tuple[str, ...] = ()


def _build() -> None:
    """(Re)build ``TABLE``, ``ROUTED`` and ``UPSTREAM`` from the registered families (on
    import, and whenever ``fa_lab.kernels.register`` adds one)."""
    global ROUTED, UPSTREAM
    TABLE.clear()
    TABLE.update(_entries())
    ROUTED = tuple(name for name, fam in FAMILIES.items() if fam.routed)
    UPSTREAM = tuple(name for name in ROUTED if FAMILIES[name].upstream)
    _FORWARDS.clear()


_FORWARDS: dict = {}
_build()
kernels._LISTENERS.append(_build)


def serving(feature: str) -> Family:
    """The family an entry point of its own runs for calls with ``feature`` (a sliding
    ``"window"``: ``swa_attn_func``): the one registered family, not routed, whose model
    claims it. ValueError where none or several do (a new one must say which it is)."""
    found = [fam for fam in FAMILIES.values()
             if not fam.routed and feature in fam.implementations["model"].caps.features]
    if len(found) != 1:
        raise ValueError(f"{len(found) or 'no'} unrouted kernel famil{'y' if len(found) < 2 else 'ies'}"
                         f" claim the {feature!r} feature ({', '.join(f.name for f in found)}); "
                         "exactly one must")
    return found[0]


def entry(family: str, backend: str) -> Entry:
    if (family, backend) not in TABLE:
        raise ValueError(f"backend={backend!r} has no {family} kernel; it has "
                         f"{sorted(f for f, b in TABLE if b == backend)}")
    return TABLE[(family, backend)]


def policy_refusal(e: Entry, policy: Policy) -> str | None:
    """Why ``e`` cannot run ``policy`` (naming the field and the backend), or None."""
    return capabilities.policy_refusal(e.caps, policy,
                                       f"the {e.family} kernel on backend={e.backend!r}")


def supports(e: Entry, policy: Policy) -> bool:
    return policy_refusal(e, policy) is None


@dataclass(frozen=True)
class Call:
    """A checked call: everything a backend receives, checked once (``api.check_call``).

    ``request``: the rescale arguments as given (``policies.Request``, ``rescale`` as a
    Policy); ``policy_asked``: whether the caller asked for a rescale (``Request.explicit``
    under the call's upstream ``version``); ``policy``: the policy resolved from them for
    the routed family (set by ``plan``); ``mods``: the bias / alibi_slopes / sink /
    num_kv_splits that were given; ``options``: a family's own keyword arguments passed to
    its ``forward`` as given (the SWA window); ``packing``: varlen boundaries (q, k, v then
    packed [total, H, D]); ``kernel_asked``: the kernel= given, if any; ``dtype``,
    ``features`` and ``arch``: what routing reads (``fa_lab.routing.Shape``)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    causal: bool
    request: Request
    fp8: bool
    descales: tuple[float, float, float] | None
    fp8_saturate: bool
    backend: str
    mods: dict
    head_dim: int
    batch: int
    seqlen_q: int
    seqlen_kv: int
    dtype: str
    features: tuple
    version: Version
    policy_asked: bool
    packing: varlen.Packing | None = None
    kernel_asked: str | None = None
    return_lse: bool = False
    options: dict = dataclasses.field(default_factory=dict)
    arch: str = routing.DUALWAVE_ARCH
    policy: Policy | None = None
    head_dim_v: int | None = None

    @property
    def upstream(self) -> str:
        """The upstream version's name."""
        return self.version.name

    def _with(self, **changes) -> "Call":
        """A copy with ``changes`` (the fields stay as checked)."""
        new = object.__new__(Call)
        new.__dict__.update(self.__dict__)
        new.__dict__.update(changes)
        return new


@dataclass(frozen=True)
class Plan:
    """A call decided once: its family, backend and entry settled, its policy resolved
    for that family (``call.policy``). ``run`` executes it as it stands."""

    call: Call
    family: str
    backend: str
    entry: Entry | None  # None for backend="flydsl"


def semantic_family(policy: Policy) -> str | None:
    """The routed family whose model runs every ``fa_lab.semantics`` field ``policy`` sets
    away from its default (the online-softmax family), or None for a policy that sets none:
    no FlyDSL kernel has such semantics, so such a policy runs there whatever the shape."""
    if policy is None or not policy.semantic_fields:
        return None
    able = [f for f in ROUTED if capabilities.semantics_refusal(
        TABLE[(f, "emulator")].caps, policy, f) is None]
    if not able:
        raise ValueError(f"no kernel family runs policy {policy.name!r}: it sets semantics "
                         f"field(s) {', '.join(policy.semantic_fields)}")
    return able[0]


def _lacks(fam: Family, shape, policy: Policy | None, impl: str | None) -> str | None:
    """What ``fam`` lacks to run a call of ``shape`` with ``policy`` on implementation
    ``impl`` (None: the model): the implementation, a feature or the policy; None if
    nothing."""
    if impl is not None and impl not in fam.implementations:
        return f"no {impl} implementation"
    caps = fam.implementations["model"].caps
    for f in shape.features:
        if f not in caps.features:
            return f"no {f}"
    if policy is not None:
        return capabilities.policy_refusal(caps, policy, f"the {fam.name} kernel")
    return None


def _stand_in(shape, policy: Policy | None, impl: str | None, but: str) -> str | None:
    """The first upstream family other than ``but`` that takes ``shape``'s dtype, can run
    the shape (its rule does not refuse it) and lacks nothing (``_lacks``)."""
    for name in UPSTREAM:
        fam = FAMILIES[name]
        if (name != but and shape.dtype in fam.implementations["model"].caps.dtypes
                and fam.rule.refuses(shape) is None and _lacks(fam, shape, policy, impl) is None):
            return name
    return None


def _asked(kernel: str, shape, policy: Policy | None) -> str:
    """``kernel=``'s family, once it is shown to run ``shape`` and ``policy``."""
    fam = FAMILIES[kernel]
    caps = fam.implementations["model"].caps
    if shape.dtype not in caps.dtypes:
        able = [n for n in UPSTREAM if shape.dtype in FAMILIES[n].implementations["model"].caps.dtypes]
        raise ValueError(f"kernel={kernel!r} does not take {DTYPE_NAMES[shape.dtype]} inputs: it "
                         f"takes {'/'.join(DTYPE_NAMES[d] for d in sorted(caps.dtypes))} inputs only; "
                         f"{shape.dtype} runs on {' or '.join(map(repr, able))}")
    if fam.rule is not None:
        why = fam.rule.refuses(shape)
        if why:
            raise ValueError(f"kernel={kernel!r}: {why}")
    if policy is not None and capabilities.policy_refusal(caps, policy, kernel) is not None:
        other = semantic_family(policy) or _stand_in(shape, policy, None, kernel)
        hint = "" if other is None else f"; drop one of the two, or use kernel={other!r}"
        raise ValueError(f"kernel={kernel!r} has no rescale={policy.name!r}: "
                         f"{policy_refusal(TABLE[(kernel, 'emulator')], policy)}{hint}")
    for f in shape.features:
        if f not in caps.features:
            other = _stand_in(shape, policy, None, kernel)
            said = ("folds in no " if f in routing.SCORE_FEATURES else "has no ") + _FEATURE_NAMES.get(f, f)
            raise ValueError(f"kernel={kernel!r} {said}" + (
                "" if other is None else f"; {_FEATURE_NAMES.get(f, f)} runs on kernel={other!r}"))
    return kernel


#: How errors name a feature.
_FEATURE_NAMES = {"num_kv_splits": "split-K (num_kv_splits > 1)", "varlen": "varlen (cu_seqlens)",
                  "paged": "paged KV (block_table)"}


def _route(shape, policy: Policy | None, kernel: str | None, impl: str | None):
    """(the family that runs a call of ``shape``, the upstream family it replaces or None,
    whether the asked ``policy`` alone made the difference). ``policy``: the policy the
    caller asked for (None: none); ``kernel``: ``kernel=``; ``impl``: the implementation
    the backend runs (None: the model)."""
    if kernel is not None:
        return _asked(kernel, shape, policy), None, False
    if policy is not None and policy.semantic_fields:
        return semantic_family(policy), None, False
    routed = None
    for name in UPSTREAM:
        if FAMILIES[name].rule.takes(shape):
            routed = name
            break
    if routed is None:
        raise ValueError(f"no kernel family takes {shape.dtype} calls of head dim {shape.head_dim}")
    fam = FAMILIES[routed]
    why = fam.rule.refuses(shape)
    if why:
        raise ValueError(why)
    if _lacks(fam, shape, policy, impl) is None:
        return routed, None, False
    other = _stand_in(shape, policy, impl, routed)
    if other is None:
        lacking = _lacks(fam, shape, policy, impl)
        if policy is not None and _lacks(fam, shape, None, impl) is None:
            # the upstream kernels that would run the policy, and why they cannot run this call
            others = [FAMILIES[n].rule for n in UPSTREAM if n != routed and shape.dtype in
                      FAMILIES[n].implementations["model"].caps.dtypes]
            raise ValueError(f"rescale={policy.name!r} needs the "
                             f"{' or '.join(r.kernel for r in others) or 'another'} kernel ("
                             f"{'; '.join(filter(None, (r.refuses(shape) for r in others)))}), "
                             f"where only the {fam.rule.kernel} kernel runs: {lacking}")
        return routed, None, False  # plan refuses what the family lacks, naming it
    return other, routed, policy is not None and _lacks(fam, shape, None, impl) is None


def choose_kernel(*, batch: int, seqlen_q: int, fp8: bool, rescale=None, kernel: str | None = None,
                  has_bias: bool = False, has_alibi: bool = False, has_sink: bool = False,
                  head_dim: int = 128, arch: str = routing.DUALWAVE_ARCH) -> str:
    """The family that runs a dense call of this shape on the models: upstream's routing
    (each upstream family's ``Rule``), except that an explicit ``rescale`` (a name or
    Policy) the routed kernel lacks selects the upstream kernel that has it, a policy with
    semantics of its own (``Policy.semantic_fields``) selects the family that runs them
    (``semantic_family``: the online-softmax model), and an explicit ``kernel`` wins but
    must be able to do what was asked (and the features asked for). bf16 stands for
    bf16/f16. The same rules as ``plan``'s routing (``_route``)."""
    routing.check_positive_int("batch", batch)
    routing.check_positive_int("seqlen_q", seqlen_q)
    routing.check_bool("fp8", fp8)
    routing.check_positive_int("head_dim", head_dim)
    routing.check_arch(arch)
    features = routing.features(has_bias, has_alibi, has_sink)
    if kernel is not None and (not isinstance(kernel, str) or kernel not in ROUTED):
        raise ValueError(f"kernel={kernel!r} is not a kernel fa_lab routes; choose one of "
                         f"{ROUTED} (the others have entry points of their own)")
    policy = None if rescale is None else as_policy(rescale)
    shape = routing.Shape(batch, seqlen_q, head_dim, "fp8" if fp8 else "bf16", tuple(features), arch)
    return _route(shape, policy, kernel, None)[0]


def auto_backend(family: str, device_type: str, features, policy: Policy, triton: bool) -> str:
    """What ``backend="auto"`` runs: the faithful Triton port for GPU tensors when Triton
    imports (``triton``) and the port covers the features and the policy; else the model."""
    e = TABLE.get((family, "triton"))
    if device_type == "cuda" and triton and e is not None and supports(e, policy) \
            and set(features) <= e.caps.features:
        return "triton"
    return "emulator"


def _resolve_backend(call: Call, family: str) -> str:
    if call.backend != "auto":
        return call.backend
    if call.q.device.type != "cuda":
        return "emulator"
    from fa_lab.kernels import available
    return auto_backend(family, "cuda", call.features, call.policy, available())


class RoutingWarning(UserWarning):
    """A call runs on another kernel than upstream's would, or its policy is never consulted
    there: what ran differs from what the call seems to ask for."""


#: The (reason, family, policy) of every warning ``plan`` gave: each is given once.
_WARNED: set = set()
_QUIET = contextvars.ContextVar("fa_lab_routing_quiet", default=False)


@contextlib.contextmanager
def routing_quiet():
    """Calls made inside give no routing warning and leave each one unspent: for a tool's
    own calls (the attack's candidates and their shrinking), whose shapes the user did not
    choose. Usable as a decorator."""
    token = _QUIET.set(True)
    try:
        yield
    finally:
        _QUIET.reset(token)


def _warn_once(key, message: str) -> None:
    """Warn at the user's line: the first frame outside fa_lab (``checks.caller_stacklevel``)."""
    if key not in _WARNED and not _QUIET.get():
        _WARNED.add(key)
        warnings.warn(message, RoutingWarning, stacklevel=caller_stacklevel())


def _paged_kernel(call: Call) -> bool | str:
    """What ``Version.default_policy`` reads of a paged call: the paged fp8 kernel it runs
    (``fa_lab.paged.PagedFp8.schedule``), True for another paged call, False for none."""
    if "paged" not in call.features:
        return False
    return getattr(call.mods.get("paged"), "schedule", True)


def route(call: Call, notes: list) -> str:
    """The family that runs ``call``: ``kernel=``'s, or the one that runs the asked
    policy's semantics, or upstream's routing (each upstream family's ``Rule``), where a
    family that lacks what the call asks (the policy, a feature, the backend's
    implementation) gives way to the first upstream family that has it. A reroute for the
    policy alone is appended to ``notes`` as (key, message)."""
    wanted = None
    if call.policy_asked:
        wanted = call.request.rescale
        if wanted is None:
            wanted = call.version.default_policy(fp8=call.fp8,
                                                 lazy_flag=call.request.lazy_flag is not False,
                                                 paged=_paged_kernel(call))
    family, upstreams, policy_only = _route(call, wanted, call.kernel_asked,
                                            IMPLEMENTATION.get(call.backend))
    if policy_only:
        has = "a Python rule" if wanted.rule is not None else f"vote={wanted.vote!r}"
        notes.append((("rerouted", upstreams, wanted.vote, wanted.rebase, wanted.rule),
                      f"{call.request.given()}: upstream runs this call (B={call.batch}, "
                      f"Sq={call.seqlen_q}) on the {upstreams} kernel, which cannot apply "
                      f"{wanted.name!r} ({has}); fa_lab runs it on {family} instead, where it "
                      f"applies. Pass kernel={family!r} to ask for that explicitly (and no "
                      "warning), or leave the rescale out to run what upstream runs"))
    return family


def resolve_policy(call: Call, family: str, notes: list) -> Policy:
    """The policy ``family`` runs for ``call``: the one asked for, resolved against the call,
    or the upstream version's default where the family runs it (else eager, as upstream
    hands the lazy flag to DUALWAVE_SWP only). A lazy policy asked for that the family
    would never consult (``Family.unconsulted``) is run, and a note in ``notes`` says so."""
    fam = FAMILIES[family]
    caps = fam.implementations["model"].caps
    default = None
    if call.request.rescale is None:
        default = call.version.default_policy(fp8=call.fp8, lazy_flag=call.request.lazy_flag is not False,
                                              paged=_paged_kernel(call))
        if not call.policy_asked and capabilities.policy_refusal(caps, default, family) is not None:
            default = get("eager")  # upstream hands the lazy flag to DUALWAVE_SWP only
    policy = call.request.resolve(fp8=call.fp8, seqlen_kv=call.seqlen_kv, default=default,
                                  headroom_any_dtype=caps.headroom_any_dtype)
    if call.policy_asked and policy.lazy and fam.unconsulted is not None:
        why = fam.unconsulted(call, policy)
        if why:
            # keyed by the rule, not its numbers: a policy's variants (a dashboard's moved
            # threshold) are the same policy here
            notes.append((("never consulted", family, policy.vote, policy.rebase, policy.rule), why))
    return policy


def plan(call: Call) -> Plan:
    """Route (``route``), resolve the policy for that family (``resolve_policy``), then
    pick the backend and check every capability; raises ValueError naming what the chosen
    backend cannot do. Does no work on the tensors' data. Routing's warnings (each once) are
    given only once every check has passed: a call that is refused is refused in silence."""
    notes: list = []
    planned = _plan(call, notes)
    for key, message in notes:
        _warn_once(key, message)
    return planned


def plan_decided(call: Call, family: str, policy: Policy) -> Plan:
    """The plan of ``call``, whose family and resolved policy an earlier ``plan`` of a call
    of the same shape, dtype and options decided (a sweep's point, decided when its grid
    was expanded): nothing is routed or resolved again; the backend and every capability
    are checked as ``plan`` checks them, on ``call``'s own tensors."""
    if family not in FAMILIES:
        raise ValueError(f"no kernel family {family!r}; the families are {list(FAMILIES)}")
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a resolved fa_lab.Policy, got {type(policy).__name__}")
    return _plan(call, [], (family, policy))


def _plan(call: Call, notes: list, decided: tuple | None = None) -> Plan:
    if decided is None:
        family = route(call, notes)
        call = call._with(policy=resolve_policy(call, family, notes))
    else:  # (family, resolved policy), decided by an earlier plan (``plan_decided``)
        family, policy = decided
        call = call._with(policy=policy)
    backend = call.backend if call.backend != "auto" else _resolve_backend(call, family)
    if backend == "flydsl":
        if not FAMILIES[family].routed:
            raise ValueError(f"backend='flydsl' runs upstream's flydsl_flash_attn_func, which does "
                             f"not route to the {family} kernel; use 'emulator', 'triton', "
                             "'interpret' or 'auto'")
        return Plan(call, family, backend, None)
    e = TABLE.get((family, backend)) or entry(family, backend)
    if e.device is not None and call.q.device.type != e.device:
        hint = ("use backend='interpret' (Triton's CPU interpreter) or 'emulator'"
                if e.device == "cuda" else "use backend='triton' or 'emulator'")
        need = "CPU" if e.device == "cpu" else "CUDA/ROCm"
        raise ValueError(f"backend={backend!r} needs {need} tensors, got tensors on "
                         f"{call.q.device}; {hint}")
    if call.dtype not in e.caps.dtypes:
        raise ValueError(f"backend={backend!r} has no {family} kernel for {call.dtype} inputs")
    if call.head_dim not in e.caps.head_dims:
        raise ValueError(f"backend={backend!r}: the {family} kernel takes head dims {e.caps.head_dims}, "
                         f"got D={call.head_dim}")
    dv = call.head_dim_v if call.head_dim_v is not None else call.head_dim
    if dv not in (e.caps.head_dims_v or (call.head_dim,)):
        takes = (f"Dv in {e.caps.head_dims_v}" if e.caps.head_dims_v
                 else "v's head dim equal to q's (Dv = D)")
        raise ValueError(f"backend={backend!r}: the {family} kernel takes {takes}, got v head dim "
                         f"Dv={dv} with D={call.head_dim}")
    missing = () if e.caps.features.issuperset(call.features) else [
        f for f in call.features if f not in e.caps.features]
    if missing:
        raise ValueError(f"{', '.join(missing)} not supported by the {family} kernel on "
                         f"backend={backend!r}; {_feature_advice(family, backend, missing, call.policy)}")
    refusal = capabilities.policy_refusal(e.caps, call.policy,
                                          f"the {family} kernel on backend={backend!r}")
    if refusal:
        raise ValueError(refusal)
    capabilities.cleared(call.policy).add((family, e.impl))  # its entry point decides no more
    if e.triton:
        from fa_lab.kernels import unavailable
        why = unavailable()
        if why:
            raise RuntimeError(f"backend={backend!r} cannot run: {why}")
    return Plan(call, family, backend, e)


def _feature_advice(family: str, backend: str, missing: list, policy) -> str:
    """What runs ``missing`` features: another backend of ``family``, or else the kernels
    that have them (never the backend the call already uses)."""
    def has(e):
        return all(f in e.caps.features for f in missing)
    others = [b for b in BACKENDS if b != backend and (family, b) in TABLE and has(TABLE[(family, b)])]
    if others:
        return f"use backend={others[0]!r}"
    kernels = sorted({f for (f, _), e in TABLE.items() if has(e)})
    advice = f"no backend of the {family} kernel implements it"
    if kernels:
        advice += f" (the {', '.join(kernels)} kernel{'s' if len(kernels) > 1 else ''} do{'es' if len(kernels) == 1 else ''})"
    if getattr(policy, "semantic_fields", ()):
        advice += (f"; policy {policy.name!r} sets semantics fields, which only the "
                   f"{semantic_family(policy)} kernel runs: drop the feature, or use a policy "
                   "without them")
    return advice


def _forward(e: Entry):
    """(the implementation's module, whether its ``forward`` takes ``policy=``), cached in
    ``_FORWARDS`` (``forward`` is read from the module at each call)."""
    key = (e.family, e.impl)
    if key not in _FORWARDS:
        _FORWARDS[key] = e.load(), FAMILIES[e.family].implementations[e.impl].policy
    return _FORWARDS[key]


def _kwargs(p: Plan, recorder, with_policy: bool) -> dict:
    c, e = p.call, p.entry
    kw = {"causal": c.causal}
    if "trace" in e.caps.features:
        kw["recorder"] = recorder
    elif recorder is not None:
        raise ValueError(f"backend={p.backend!r} records no trace; trace the model "
                         "(backend='emulator') or a faithful port")
    if e.triton:
        kw["interpret"] = c.q.device.type == "cpu"
    if with_policy:  # (a kernel with one fixed eager rule takes no policy=)
        kw["policy"] = c.policy
    if c.fp8:
        qd, kd, vd = c.descales
        kw.update(q_descale=qd, k_descale=kd, v_descale=vd, saturate=c.fp8_saturate)
    if c.options:
        kw.update(c.options)
    return kw


def _run_dense(p: Plan, recorder=None):
    c = p.call
    module, with_policy = _FORWARDS.get((p.family, p.entry.impl)) or _forward(p.entry)
    return module.forward(c.q, c.k, c.v, **_kwargs(p, recorder, with_policy), **c.mods)


def run(p: Plan, recorder=None):
    """Execute a planned call as planned; returns (out, lse)."""
    c = p.call
    if p.backend == "flydsl":
        if recorder is not None:
            raise ValueError("backend='flydsl' runs upstream's kernel, which records no trace or "
                             "counts; trace and count_rescales take the other backends")
        from fa_lab import flydsl
        return flydsl.forward(c)
    if c.packing is None:
        module, with_policy = _FORWARDS.get((p.family, p.entry.impl)) or _forward(p.entry)
        return module.forward(c.q, c.k, c.v, **_kwargs(p, recorder, with_policy), **c.mods)
    if recorder is not None:
        raise ValueError("trace and count_rescales take dense calls, not varlen")
    pk = c.packing
    if p.entry.has_varlen:
        _, with_policy = _forward(p.entry)
        kw = {k: v for k, v in _kwargs(p, None, with_policy).items() if k != "recorder"}
        return p.entry.varlen_load().forward_varlen(
            c.q, c.k, c.v, pk.cu_q_tensor, pk.cu_kv_tensor, pk.max_seqlen_q, pk.max_seqlen_kv,
            **kw, **c.mods)
    dense_mods = {k: v for k, v in c.mods.items() if k not in ("bias", "alibi_slopes")}

    def dense(qb, kb, vb, **seq_mods):
        mods = {**dense_mods, **seq_mods}
        sub = c._with(q=qb, k=kb, v=vb, mods=mods, packing=None, features=tuple(mods))
        return _run_dense(dataclasses.replace(p, call=sub))

    return varlen.run(pk, c.q, c.k, c.v, dense, bias=c.mods.get("bias"),
                      alibi_slopes=c.mods.get("alibi_slopes"))
