"""The session's network call compiled with ``torch.compile``, one graph per fed shape.

The session keeps every shape inside the network a function of the fed shape alone (see
:mod:`.slot_session`), so each shape compiles once. Compiling must never cost a generation:
shapes past the first ``MAX_COMPILED_SHAPES`` run eagerly (compile time stays bounded), and when
compiling or running a compiled graph raises anything, the call is repeated eagerly and every
later call runs eagerly too, with one warning for the run's summary. Repeating the call is safe:
the network only writes the fed tokens' keys and values at their planned columns, which the
eager run writes again.

Compiled graphs outlive a generation (torch keeps them per function), so a later generation of
the same shapes does not compile again. Torch holds at most ``PROCESS_GRAPHS`` of them per
function; past that it would run the network uncompiled without a word, so here it raises, and
the run warns as for any other failure.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...messages import first_line

__all__ = ["MAX_COMPILED_SHAPES", "CompiledNetwork"]

MAX_COMPILED_SHAPES = 8  # distinct fed shapes compiled per generation; later ones run eagerly
PROCESS_GRAPHS = 64  # graphs torch keeps per network function, over every generation of a process

Network = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def compile_mode(device: torch.device) -> str | None:
    """``torch.compile``'s mode on ``device``: CUDA graphs on CUDA (they remove the launch cost
    of every kernel, what a decoding step of a large model is bound by), inductor's default
    elsewhere."""
    return "reduce-overhead" if device.type == "cuda" else None


def _failure(error: Exception) -> str:
    """The warning for a run whose compiling failed with ``error``."""
    return (f"compile=True: torch.compile failed ({type(error).__name__}: {first_line(error)}), "
            "so the network ran uncompiled for the rest of this generation (the same "
            "distribution, only slower)")


class CompiledNetwork:
    """``network(inputs, positions, mask)`` compiled per fed shape, or eager (see the module).

    shapes: the fed shapes that ran compiled; ``eager_shapes``: those that ran eagerly because
    ``MAX_COMPILED_SHAPES`` were compiled already; ``failure``: why compiling stopped, a
    sentence for the run's warnings (None while it works).
    """

    def __init__(self, network: Network, device: torch.device) -> None:
        self._eager = network
        self.shapes: set[tuple] = set()
        self.eager_shapes: set[tuple] = set()
        self.failure: str | None = None
        try:
            self._compiled = torch.compile(network, dynamic=False, fullgraph=False,
                                           mode=compile_mode(device))
        except Exception as error:  # torch.compile refuses this Python or platform
            self._compiled, self.failure = None, _failure(error)

    def __call__(self, inputs: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
                 ) -> torch.Tensor:
        shape = (tuple(inputs.shape), tuple(positions.shape), tuple(mask.shape))
        if shape not in self.shapes and len(self.shapes) >= MAX_COMPILED_SHAPES:
            self.eager_shapes.add(shape)
        if self.failure is not None or shape in self.eager_shapes:
            return self._eager(inputs, positions, mask)
        try:
            with torch._dynamo.config.patch(recompile_limit=PROCESS_GRAPHS,
                                            fail_on_recompile_limit_hit=True):
                hidden = self._compiled(inputs, positions, mask)
        except Exception as error:  # any failure of compiling falls back to eager
            self.failure = _failure(error)
            return self._eager(inputs, positions, mask)
        self.shapes.add(shape)
        return hidden

    def report(self) -> dict:
        """What the trace records: shapes compiled and run eagerly, and the failure if any."""
        return {"compiled_shapes": len(self.shapes), "eager_shapes": len(self.eager_shapes),
                "failure": self.failure}
