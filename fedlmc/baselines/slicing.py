"""HeteroFL (Diao et al., ICLR 2021) for mixed widths: every client trains an index prefix of the global
model, and each entry is averaged over the clients that hold it. With mixed depths, the same rule is
InclusiveFL's / DepthFL's without distillation: a shallow client trains the global model's first blocks
(and the head), each block averaged over the clients that have it."""

from __future__ import annotations

from fedlmc.strategies.base import FedlmcStrategy
from fedlmc.strategies.hetero import HeteroWidthFedAvg, build_hetero, slicing_aggregate
from fedlmc.strategies.registry import Build, register


class SlicingFedAvg(FedlmcStrategy):
    """HeteroFL-style baseline for mixed widths: clients train index prefixes of the global model
    (they slice what they receive); aggregation averages each entry over the clients that hold it.

    Parameters
    ----------
    **kwargs
        ``FedlmcStrategy``'s parameters (``model``: the global, widest model or config, required) and
        Flower's ``FedAvg``'s.
    """

    needs_architecture = True

    same_shape = False

    def combine(self, server_round, replies, models, weights):
        if self._previous is None or self.global_config is None:
            raise ValueError("SlicingFedAvg needs model= and a previous global model (configure_train)")
        result = slicing_aggregate(models, weights, self._previous.to_torch_state_dict(), self.global_config)
        return (
            result,
            {"widths": [int(m.config.d_model) for m in models], "depths": [int(m.config.n_layer) for m in models]},
            None,
        )


@register(
    "slicing",
    summary="HeteroFL, each width the wide model's leading slice (each depth its first blocks)",
    mixed_widths=True,
    mixed_depths=True,
    example="SlicingFedAvg(model=model)",
    client="builds its model at the width of the arrays it receives",
)
def _slicing(b: Build):
    return SlicingFedAvg(**b.common())


class ZeroPaddedDepthFedAvg(HeteroWidthFedAvg):
    """The naive mixed-depth merge, a baseline: as ``HeteroWidthFedAvg``, but the shallower clients'
    identity padding is averaged in as zeros (each block over every client, not over its holders).

    Parameters
    ----------
    **kwargs
        ``HeteroWidthFedAvg``'s parameters.
    """

    depth_padding = "zeros"


@register(
    "hetero-zeros",
    summary="mixed depths aligned as hetero, the identity padding averaged as zeros",
    mixed_depths=True,
    example="ZeroPaddedDepthFedAvg(model=model)",
    client="builds its model at the depth of the arrays it receives",
)
def _hetero_zeros(b: Build):
    return build_hetero(b, refine=False, cls=ZeroPaddedDepthFedAvg)
