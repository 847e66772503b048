"""HeteroFL (Diao et al., ICLR 2021) for mixed widths: every client trains an index prefix of the global
model, and each entry is averaged over the clients that hold it."""

from __future__ import annotations

from fedlmc.strategies.base import FedlmcStrategy
from fedlmc.strategies.hetero import slicing_aggregate
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
        return result, {"widths": [int(m.config.d_model) for m in models]}, None


@register(
    "slicing",
    summary="HeteroFL, each width the wide model's leading slice",
    mixed_widths=True,
    example="SlicingFedAvg(model=model)",
    client="builds its model at the width of the arrays it receives",
)
def _slicing(b: Build):
    return SlicingFedAvg(**b.common())
