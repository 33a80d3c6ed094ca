"""The list forms of two of :class:`pccl.torch.ProcessGroup`'s collectives: torch's
``reduce_scatter(output, input_list)`` — outputs of one size on every peer (a pccl
reduce-scatter) or of different sizes (an all-reduce of the concatenated list, of which each peer
keeps its part) — and ``all_gather_coalesced(output_lists, input_list)`` (one pccl all-gather of
the concatenated inputs)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import blocking
from ..errors import CollectiveAborted, InvalidArgument
from ..types import ReduceOp
from ._args import dense, split_columns, tensor_list, torch_reduce_op, wire_view
from .ranks import by_rank
from .work import Work

__all__ = ["ListForms"]


class ListForms:
    """``reduce_scatter`` and ``allgather_coalesced`` (a mixin of the group: it runs on the
    group's communicator and collective machinery)."""

    _comm: blocking.Communicator

    def _start(self, call: Callable[[int], Any], finish: Callable[[Any], list[torch.Tensor]],
               alone: Callable[[], list[torch.Tensor]] | None) -> Work:
        raise NotImplementedError  # the group's

    def _reduce_scatter(self, work: torch.Tensor, outputs: list[torch.Tensor], op: ReduceOp) -> Work:
        raise NotImplementedError  # the group's

    def getRank(self) -> int:  # noqa: N802 - torch's name
        raise NotImplementedError  # the group's

    def getSize(self) -> int:  # noqa: N802 - torch's name
        raise NotImplementedError  # the group's

    def peers_by_rank(self) -> tuple[int, ...]:
        raise NotImplementedError  # the group's

    def reduce_scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None,  # type: ignore[override]
                       timeout: Any = None, *, op: Any = None) -> Work:
        """torch's list ``reduce_scatter`` (also ``pg.reduce_scatter(out, inputs, op)``): the
        one output gets the reduction over the group of ``input_tensors[0][rank()]``, which has
        the output's size.  Inputs all of one size run as a pccl reduce-scatter; of different
        sizes (torch's uneven ``reduce_scatter``: input ``r`` sized as rank ``r``'s output) as
        an all-reduce of a copy of their concatenation, of which this peer keeps its part."""
        if isinstance(output_tensors, torch.Tensor):
            output_tensors, input_tensors = [output_tensors], [input_tensors]
        outputs = tensor_list(output_tensors, "reduce_scatter")
        if len(outputs) != 1 or len(input_tensors) != 1:
            raise InvalidArgument(f"reduce_scatter takes one output and one list of inputs per process on pccl, "
                                  f"got {len(outputs)} and {len(input_tensors)}")
        world, rank = self.getSize(), self.getRank()
        output, inputs = outputs[0], tensor_list(input_tensors[0], "reduce_scatter")
        if len(inputs) != world or inputs[rank].numel() != output.numel():
            raise InvalidArgument(f"reduce_scatter needs one input per peer ({world} now), the one at this peer's "
                                  f"rank of the output's {output.numel()} elements")
        for t in inputs:
            if t.dtype != output.dtype:
                raise InvalidArgument(f"reduce_scatter: invalid tensor type: {t.dtype}, expected {output.dtype} "
                                      "(pccl does not cast)")
        reduce_op = torch_reduce_op(opts, op)
        flat = torch.cat([t.detach().reshape(-1) for t in inputs])
        if all(t.numel() == output.numel() for t in inputs):
            return self._reduce_scatter(flat, [output], reduce_op)
        start = sum(t.numel() for t in inputs[:rank])

        def finish(info: Any = None) -> list[torch.Tensor]:
            output.copy_(flat[start:start + output.numel()].reshape(output.shape))
            return [output]

        return self._start(lambda tag: self._comm.all_reduce_async(flat, op=reduce_op, tag=tag), finish, finish)

    def allgather_coalesced(self, output_lists: Any, input_list: Any, opts: Any = None) -> Work:  # type: ignore[override]
        """torch's ``all_gather_coalesced``: ``output_lists[r][i]`` gets rank ``r``'s
        ``input_list[i]`` (one list per peer, each shaped as ``input_list``; one dtype), in one
        pccl all-gather of the concatenated inputs."""
        inputs = tensor_list(input_list, "allgather_coalesced")
        order = self.peers_by_rank()
        world = len(order)
        lists = [list(o) for o in output_lists]
        if len(lists) != world:
            raise InvalidArgument(f"allgather_coalesced: output lists should be equal to world size ({world} now), "
                                  f"got {len(lists)}")
        for outs in lists:
            if len(outs) != len(inputs):
                raise InvalidArgument(f"allgather_coalesced: each output list holds one tensor per input "
                                      f"({len(inputs)}), got {len(outs)}")
            for i, (out, inp) in enumerate(zip(outs, inputs)):
                dense(out, "allgather_coalesced", i)
                if out.numel() != inp.numel():
                    raise InvalidArgument(f"allgather_coalesced: invalid size of output tensor at index {i}: "
                                          f"{out.numel()} elements for an input of {inp.numel()}")
                if out.dtype != inp.dtype or inp.dtype != inputs[0].dtype:
                    raise InvalidArgument(f"allgather_coalesced: invalid tensor type at index {i}: {out.dtype} "
                                          f"for an input of {inp.dtype} (one dtype; pccl does not cast)")
        flat = torch.cat([t.detach().reshape(-1) for t in inputs])

        def place(parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
            if len(parts) != world:
                raise CollectiveAborted(f"the group changed size: the all-gather ran over {len(parts)} peers, "
                                        f"not the {world} the outputs were made for; retry")
            for i, chunks in enumerate(split_columns(parts, [t.numel() for t in inputs])):
                for outs, chunk in zip(lists, chunks):
                    outs[i].copy_(chunk.reshape(outs[i].shape))
            return [t for outs in lists for t in outs]

        return self._start(lambda tag: self._comm.all_gather_async(wire_view(flat), tag=tag),
                           lambda gathered: place(by_rank(gathered.peers, gathered.arrays, order)),
                           (lambda: place([flat])) if world == 1 else None)
