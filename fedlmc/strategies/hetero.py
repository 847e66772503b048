"""Mixed-width and mixed-depth federations: clients train models of different widths, or depths.

* ``HeteroWidthFedAvg`` — every reply is lifted into the universe's width (exact zero-padding, then
  rectangular-orthogonal / permutation alignment by ``universe_merge``), aggregated there, and each
  client is sent ``project(universe, T_client)``: a model of its own width in its own coordinates.
  A node the server has not aligned yet receives the universe and slices it (HeteroFL-style prefix).
  Replies of different depths (and widths) are merged by ``mixed_depths.depth_merge`` instead (each
  shallow client's blocks placed by the layer matching, identity blocks elsewhere, each block averaged
  over its holders), and each client is sent its own depth and width.
* ``SlicingFedAvg`` — the HeteroFL baseline: clients train index prefixes of one global model; each
  global entry is averaged over the clients whose sub-model contains it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from logging import INFO
from typing import Any, Optional

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.supercore import log

from fedlmc.hf import HFAdapter
from fedlmc.merging.depths import remove_blocks
from fedlmc.merging.mixed_depths import depth_merge
from fedlmc.merging.universe import project, universe_merge
from fedlmc.merging.widths import prefix_average
from fedlmc.models import from_config
from fedlmc.options import FF_LIFTS, Guard, Matching, Refinement, Universe
from fedlmc.strategies.aligned import refine_split, transform_distance
from fedlmc.strategies.base import FedlmcStrategy, declared_partition, node_of, require_nodes
from fedlmc.strategies.keys import Key
from fedlmc.strategies.records import MODEL_CONFIG_KEY, state_arrays
from fedlmc.strategies.registry import Build, register
from fedlmc.symmetry import spec_for


class HeteroWidthFedAvg(FedlmcStrategy):
    """Aggregate clients of different widths in one universe; send each its own-width projection.

    The global model is the universe (the widest architecture) in canonical (RMSNorm) form: its config
    travels with it (``model-config``).

    Parameters
    ----------
    model : model, config or list of them, optional
        The universe's (widest) fedlmc model or config; or, for Hugging Face clients, a list of the
        federation's ``transformers`` GPT-2 or ViT models or configs, one per width. Each reply is then
        read by the one whose shapes it has, the universe is kept a LayerNorm model (narrower streams are
        lifted so they stay centred), and every client is sent its projection as a model of its own
        class and width, under its own keys.
    matching : Matching, optional
        Weight matching's knobs, as ``AlignedFedAvg``'s.
    universe : Universe, optional
        The universe's iterations, as ``AlignedFedAvg``'s (a universe of fedlmc models is merged in the
        canonical form, whatever ``keep_layernorm`` says; one of Hugging Face models stays LayerNorm).
    guard : Guard, optional
        fedlmc models: in a round where every replying client had sliced the global model (HeteroFL's
        prefixes: the first round of a shared-init federation, or after the guard chose slicing), the
        slicing aggregate (``SlicingFedAvg``'s) is also built and whichever has the lower loss on
        ``guard.data`` is kept. Choosing slicing drops every client's transform, so the next round's
        clients slice again and both aggregates can be compared.
    refine : Refinement, optional
        Dirichlet refinement of every client's alignment into the universe, as ``RefinedFedAvg``'s.
    **kwargs
        ``FedlmcStrategy``'s and Flower's ``FedAvg``'s parameters.
    """

    needs_architecture = True

    same_shape = False  # replies differ in shape: each is checked against its own declared config
    depth_padding = "skip"  # mixed depths: each block averaged over its holders (ZeroPaddedDepthFedAvg: zeros)

    def __init__(
        self,
        *,
        model: Any = None,
        matching: Optional[Matching] = None,
        universe: Optional[Universe] = None,
        guard: Optional[Guard] = None,
        refine: Optional[Refinement] = None,
        **kwargs: Any,
    ) -> None:
        models = list(model) if isinstance(model, (list, tuple)) else None
        super().__init__(model=None if models is not None else model, **kwargs)
        self.adapters: list[HFAdapter] = []
        if models is not None:
            self.adapters = sorted((HFAdapter(m) for m in models), key=lambda a: -a.config.d_model)
            if len({a.family.model_class for a in self.adapters}) != 1:
                raise ValueError("HeteroWidthFedAvg(model=[...]) takes one Hugging Face model class in several widths")
            self.adapter = self.adapters[0]  # the universe's (widest) form: the global model's arrays
            self.global_config = self.adapter.config.to_dict()
        elif self.adapter is not None:
            self.adapters = [self.adapter]
        if any(a.config.arch not in ("gpt2", "vit") for a in self.adapters):
            raise ValueError(
                "HeteroWidthFedAvg aligns Hugging Face GPT-2 and ViT clients of several widths; "
                "Llama-style models (RoPE, grouped-query attention) are not supported yet"
            )
        if guard is not None and self.adapters:
            raise ValueError(
                "HeteroWidthFedAvg's slicing guard is for fedlmc models; Hugging Face clients are not sliced"
            )
        if refine is not None and refine.data is None:
            raise ValueError("HeteroWidthFedAvg(refine=...) needs Refinement(data=...) (a small server-side data set)")
        self.matching = matching if matching is not None else Matching()
        self.universe = universe if universe is not None else Universe()
        if guard is not None and guard.data is None:
            raise ValueError("HeteroWidthFedAvg's slicing guard scores models on data: Guard(data=...)")
        self.guard = guard
        self.refine = refine
        self._sliced: set[int] = set()  # nodes sent the global model itself this round (they slice it)
        self.adapter_of: dict[int, int] = {}  # client -> index of the adapter its replies are read with
        # client -> its transform into the current universe; a client is its declared partition id (stable
        # across restarts), or its node id when it declares none (a restarted federation renumbers nodes)
        self.transforms: dict[int, Any] = {}
        self.placements: dict[int, list[int]] = {}  # client -> its blocks' layers in a deeper universe
        self.partition_of: dict[int, int] = {}  # node id -> declared partition id, this process's nodes
        self._seen: set[int] = set()  # nodes that replied to this process (no need to ask who they are)
        self.query_timeout = 60.0
        self._universe = None

    def client_key(self, node: int) -> int:
        return self.partition_of.get(node, node)

    def model_for(self, node: int):
        """The model node ``node`` is sent: the universe (this round's global model) projected to its
        own width and coordinates (None for a client not aligned yet: it gets the universe and slices it)."""
        return self._own_model(self.client_key(node))

    def _own_model(self, key: int, universe=None):
        T = self.transforms.get(key)
        if universe is None:
            universe = self._universe if self._universe is not None else self.previous_model()
        if T is None or universe is None:
            return None
        own = project(universe, T)
        placed = self.placements.get(key)
        if placed is not None and len(placed) < universe.config.n_layer:  # a shallower client: its own blocks
            own = remove_blocks(own, [b for b in range(universe.config.n_layer) if b not in set(placed)])
        return own

    def returned_model(self, global_model, key: int, config):
        own = self._own_model(key, global_model) if not self.adapters else None
        return own if own is not None else super().returned_model(global_model, key, config)

    def configure_train(self, server_round: int, arrays, config: ConfigRecord, grid) -> list[Message]:
        if arrays is not self._returned:  # not this strategy's aggregate (a wrapper changed it, or a restart):
            self._universe = None  # every projection is made from the global model Flower passes
        self.learn_partitions(grid)
        return list(super().configure_train(server_round, arrays, config, grid))

    def learn_partitions(self, grid) -> None:
        """Ask nodes this process has not heard from which partition they hold (a QUERY message), so that
        after a restart each client is sent its own projection from the first round on. (A ClientApp
        without a query handler answers with an error: that node gets the universe until it replies.)"""
        if not self.transforms:
            return
        unknown = [n for n in grid.get_node_ids() if n not in self.partition_of and n not in self._seen]
        if not unknown:
            return
        queries = [Message(content=RecordDict({}), message_type=MessageType.QUERY, dst_node_id=n) for n in unknown]
        for reply in grid.send_and_receive(queries, timeout=self.query_timeout):
            pid = declared_partition(reply)
            if pid is not None:
                self.partition_of[int(reply.metadata.src_node_id)] = pid  # a grid's own reply
        log(
            INFO,
            "HeteroWidthFedAvg: %d of %d new nodes told their partition",
            sum(n in self.partition_of for n in unknown),
            len(unknown),
        )

    def adapter_for(self, msg: Message) -> Optional[HFAdapter]:
        """The adapter whose client shapes the reply has (the widest when none fits: its error names why)."""
        node = require_nodes(self, [node_of(msg)], "sending each node its own width")[0]  # remember who it is
        self._seen.add(node)
        pid = declared_partition(msg)
        if pid is not None:
            self.partition_of[node] = pid
        if len(self.adapters) < 2 or msg.has_error() or self.arrayrecord_key not in msg.content.array_records:
            return self.adapter
        arrays = msg.content.array_records[self.arrayrecord_key]
        shapes = {k: tuple(a.shape) for k, a in arrays.items()}
        for i, a in enumerate(self.adapters):
            if all(shapes.get(k, v) == v for k, v in a.template.items()) and not a.mismatch(shapes):
                self.adapter_of[self.client_key(node)] = i
                return a
        return self.adapter

    def messages_for(self, messages, config: ConfigRecord, message_type: str) -> list[Message]:
        out = []
        if message_type == MessageType.TRAIN:
            self._sliced = set()
        for msg in messages:
            node = msg.metadata.dst_node_id
            own = self.model_for(node)
            if own is None:
                out.append(msg)
                if message_type == MessageType.TRAIN:
                    self._sliced.add(int(node))
                continue
            cfg = ConfigRecord(dict(config))
            if self.adapters:  # the client's own class, width and keys
                adapter = self.adapters[self.adapter_of.get(self.client_key(node), 0)]
                arrays = ArrayRecord(torch_state_dict=adapter.to_client(own, self.client_keys))
            else:
                cfg[MODEL_CONFIG_KEY] = json.dumps(own.config.to_dict())
                arrays = state_arrays(own)
            content = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: cfg})
            out.append(Message(content=content, message_type=message_type, dst_node_id=node))
        return out

    def combine(self, server_round, replies, models, weights):
        if len({int(m.config.n_layer) for m in models}) > 1:
            return self._combine_depths(server_round, replies, models, weights)
        start = self.start_for(models)
        refine = refine_split(self.refine) if self.refine is not None else None
        universe, transforms = universe_merge(
            models,
            weights,
            start,
            matching=self.matching,
            refine=refine,
            universe=replace(self.universe, keep_layernorm=self.universe.keep_layernorm and bool(self.adapters)),
            device=self.scale.device,
        )  # HF: LayerNorm models
        widths = [int(m.config.d_model) for m in models]
        fields = {
            "moved": [transform_distance(T, spec_for(universe)) for T in transforms],
            "widths": widths,
            "kept": "aligned",
            "start": "previous" if start is not None else "reply",
        }
        log(
            INFO,
            "HeteroWidthFedAvg round %d: %d replies of widths %s aligned into width %d",
            server_round,
            len(models),
            sorted(set(widths)),
            universe.config.d_model,
        )
        nodes = require_nodes(self, [node_of(m) for m in replies], "sending each node its own width")
        previous = self._previous.to_torch_state_dict() if self._previous is not None else {}
        if (
            self.guard is not None
            and all(n in self._sliced for n in nodes)  # replies are prefixes of it
            and all(m.state_dict().keys() == previous.keys() for m in models)
        ):
            sliced = slicing_aggregate(models, weights, previous, self.global_config)
            candidates = {"aligned": universe, "slicing": sliced}
            losses = {name: self.guard_loss(self.guard, m) for name, m in candidates.items()}
            kept, verdict = self.guard_verdict(candidates, losses, "server")
            fields.update(verdict)
            if kept == "slicing":  # every client slices the new global next round (no projections)
                self._universe, self.transforms, fields["kept"] = None, {}, "slicing"
                return sliced, fields, None
        self._universe = universe
        self.transforms.update(zip([self.client_key(n) for n in nodes], transforms))
        return universe, fields, None

    def _combine_depths(self, server_round, replies, models, weights):
        """Replies of several depths (and widths): ``depth_merge`` into the deepest depth and widest shape."""
        if self.adapters:
            raise ValueError(
                "HeteroWidthFedAvg merges Hugging Face replies of several widths at one depth; this round's differ "
                f"in depth ({sorted({int(m.config.n_layer) for m in models})})"
            )
        if self.refine is not None or self.guard is not None:
            raise ValueError("HeteroWidthFedAvg's refine and guard are for one depth; mixed depths take neither")
        merged = depth_merge(
            models, weights, matching=self.matching, iterations=self.universe.iterations, padding=self.depth_padding
        )
        depths = [int(m.config.n_layer) for m in models]
        log(
            INFO,
            "HeteroWidthFedAvg round %d: %d replies of depths %s and widths %s merged into depth %d, width %d, "
            "placed at %s",
            server_round,
            len(models),
            sorted(set(depths)),
            sorted({int(m.config.d_model) for m in models}),
            merged.universe.config.n_layer,
            merged.universe.config.d_model,
            merged.positions,
        )
        nodes = require_nodes(self, [node_of(m) for m in replies], "sending each node its own depth")
        keys = [self.client_key(n) for n in nodes]
        self._universe = merged.universe
        self.transforms.update(zip(keys, merged.transforms))
        self.placements.update(zip(keys, merged.positions))
        fields = {
            "moved": [transform_distance(T, spec_for(merged.universe)) for T in merged.transforms],
            "depths": depths,
            "widths": [int(m.config.d_model) for m in models],
            "placements": merged.positions,
            "kept": "aligned",
            "start": "reply",
        }
        return merged.universe, fields, None

    def state(self) -> dict[str, Any]:
        return {
            **super().state(),
            "transforms": dict(self.transforms),
            "adapter_of": dict(self.adapter_of),
            "placements": dict(self.placements),
        }

    def load_state(self, state: dict[str, Any], round_offset: int) -> None:
        super().load_state(state, round_offset)
        self.transforms = dict(state.get("transforms", {}))
        self.placements = {int(k): list(v) for k, v in (state.get("placements") or {}).items()}
        self.adapter_of = {int(k): int(v) for k, v in (state.get("adapter_of") or {}).items()}


def slicing_aggregate(models, weights, previous: dict, config: dict):
    """HeteroFL's aggregate: each entry of the ``previous`` global state (of ``config``) averaged over the
    replies (index prefixes of it) that hold it."""
    total = sum(weights)
    sd = prefix_average([m.state_dict() for m in models], [w / total for w in weights], previous)
    result = from_config(config)
    result.load_state_dict(sd)
    return result.eval()


# ---- run_config keys and registrations ------------------------------------------------------------

FF_LIFT = Key(
    "ff-lift",
    Universe.ff_lift,
    "a narrower client's FF enters the universe as zero neurons (masked), or "
    "`split`: its own neurons split over the extra units (`Universe.ff_lift`)",
    choices=FF_LIFTS,
)


def build_hetero(b: Build, refine: bool, permutations: bool = False, cls: type = HeteroWidthFedAvg):
    s = b.settings
    # Hugging Face widths: no server-side guard model; mixed depths: no slicing to guard against
    guard = b.guard() if b.model is None and all(f == 1 for f in s.depth_list()) else None
    return cls(
        **b.common(),
        matching=b.matching(permutations),
        universe=Universe(iterations=s.iterations, ff_lift=b.key("ff-lift")),
        guard=guard,
        refine=s.refinement(b.halves()[0]) if refine else None,
    )


@register(
    "hetero",
    mixed_depths=True,
    summary="clients of several widths or depths aligned into the largest one's universe, each sent its own shape",
    server_data=True,
    mixed_widths=True,
    example="HeteroWidthFedAvg(model=model)",
    keys=(FF_LIFT,),
    client="builds its model at the width of the arrays it receives",
)
def _hetero_aligned(b: Build):
    return build_hetero(b, refine=False)


@register(
    "hetero-permuted",
    mixed_depths=True,
    summary="hetero with permutations only",
    server_data=True,
    mixed_widths=True,
    example='HeteroWidthFedAvg(model=model, matching=Matching(residual="permutation"))',
    keys=(FF_LIFT,),
    client="builds its model at the width of the arrays it receives",
)
def _hetero_permuted(b: Build):
    return build_hetero(b, refine=False, permutations=True)


@register(
    "hetero-refined",
    summary="hetero, then Dirichlet refinement",
    server_data=True,
    mixed_widths=True,
    example="HeteroWidthFedAvg(model=model, refine=Refinement(data=data))",
    keys=(FF_LIFT,),
    client="builds its model at the width of the arrays it receives",
)
def _hetero_refined(b: Build):
    return build_hetero(b, refine=True)
