"""CUDA graphs for :mod:`gpurpc.driver`: :class:`Graph` (what ``Stream.end_capture`` returns),
:class:`GraphExec` and :class:`GraphNode`. ``gpurpc.driver`` re-exports them; use them from
there.
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Tuple

import grpc

from . import _core
from ._core import SessionCore
from ._errors import LogicError
from ._functions import Function, _describe, _pack_arg
from ._streams import Stream, _stream_id
from .v1 import execution_service_pb2 as _ex

__all__ = ["GraphNode", "Graph", "GraphExec"]


_NODE_TYPES = {_ex.GRAPH_NODE_TYPE_KERNEL: "kernel", _ex.GRAPH_NODE_TYPE_MEMSET: "memset",
               _ex.GRAPH_NODE_TYPE_MEMCPY: "memcpy"}


class GraphNode:
    """A node of a :class:`Graph` (``Graph.get_nodes()``), in capture order. Pass one (or its
    index) as ``kernel_node=`` of :meth:`GraphExec.kernel_node_set_params`.

    ``type`` is ``"kernel"``, ``"memset"`` or ``"memcpy"``; kernel nodes also have
    ``function_name``, ``function_id``, ``param_layout`` (``[(offset, size), ...]``), ``grid``,
    ``block`` and ``shared`` as captured.
    """

    def __init__(self, node: Any) -> None:
        self.index: int = node.index
        self.type: str = _NODE_TYPES.get(node.type, "unspecified")
        self.function_id: int = node.function_id
        self.function_name: str = node.kernel_name
        self.param_layout: List[Tuple[int, int]] = [(p.offset_bytes, p.size_bytes)
                                                    for p in node.params]
        self.grid: Tuple[int, int, int] = (node.grid.x, node.grid.y, node.grid.z)
        self.block: Tuple[int, int, int] = (node.block.x, node.block.y, node.block.z)
        self.shared: int = node.shared_memory_bytes

    def __index__(self) -> int:
        return self.index

    __int__ = __index__

    def __repr__(self) -> str:
        if self.type == "kernel":
            return f"<gpurpc.driver.GraphNode {self.index}: kernel {self.function_name}>"
        return f"<gpurpc.driver.GraphNode {self.index}: {self.type}>"


def _keeps(dims: Any) -> bool:
    """True for the "keep the node's" value of a dimension: None or an empty sequence."""
    return dims is None or (isinstance(dims, (tuple, list)) and len(dims) == 0)


def _graph_call(core: SessionCore, name: str, request: Any, op: str) -> Any:
    """A graph RPC after the queued commands. Capture misuse and refused updates
    (FAILED_PRECONDITION of a live session) raise :class:`LogicError`, as PyCUDA raises them."""
    with core.lock:
        core.check_open(op)
        core.drain()
        return core.call(name, request, op=op)


class Graph:
    """A captured graph (``Stream.end_capture()``); ``handle`` is its id. Freed when garbage
    collected (graph execs made from it stay usable)."""

    def __init__(self, core: SessionCore, graph_id: int, node_count: int) -> None:
        self._core = core
        self.handle: int = graph_id
        self.node_count: int = node_count
        finalizer = weakref.finalize(self, core.defer_release, "graph", graph_id)
        finalizer.atexit = False

    def instantiate(self) -> "GraphExec":
        """An executable graph of it (``cuGraphInstantiate``)."""
        reply = _graph_call(self._core, "ExecutionService.InstantiateGraph",
                            _ex.InstantiateGraphRequest(graph_id=self.handle),
                            "Graph.instantiate")
        return GraphExec(self._core, reply.graph_exec_id, self)

    def get_nodes(self) -> List[GraphNode]:
        """Its nodes, in capture order."""
        reply = _graph_call(self._core, "ExecutionService.GetGraphNodes",
                            _ex.GetGraphNodesRequest(graph_id=self.handle), "Graph.get_nodes")
        return [GraphNode(node) for node in reply.nodes]

    def __repr__(self) -> str:
        return f"<gpurpc.driver.Graph {self.handle} ({self.node_count} nodes)>"


class GraphExec:
    """An executable graph (``Graph.instantiate()``); ``handle`` is its id. Freed when garbage
    collected (launches already queued still run)."""

    def __init__(self, core: SessionCore, exec_id: int, graph: Graph) -> None:
        self._core = core
        self.handle: int = exec_id
        # Kernel nodes' names and layouts, for kernel_node_set_params without func=.
        self._layouts: Optional[Dict[int, Tuple[str, List[Tuple[int, int]]]]] = None
        self._graph: Optional[Graph] = graph
        finalizer = weakref.finalize(self, core.defer_release, "graph_exec", exec_id)
        finalizer.atexit = False

    def launch(self, stream: Optional[Stream] = None) -> None:
        """Runs the graph's nodes in order on ``stream`` (default stream if None): one command
        of the command stream, asynchronous like a kernel launch."""
        core = self._core
        with core.lock:
            core.check_open("GraphExec.launch")
            core.commands.add("GraphExec.launch", launch_graph=_ex.LaunchGraphCommand(
                graph_exec_id=self.handle, stream_id=_stream_id(stream)))

    def update(self, graph: Graph) -> None:
        """Takes the parameters of ``graph`` (``cuGraphExecUpdate``): same nodes (count and
        types, in order), possibly other kernels, arguments and addresses."""
        _graph_call(self._core, "ExecutionService.UpdateGraphExec",
                    _ex.UpdateGraphExecRequest(graph_exec_id=self.handle, graph_id=graph.handle),
                    "GraphExec.update")
        self._graph = graph
        self._layouts = None

    def _node_layout(self, index: int) -> Tuple[str, List[Tuple[int, int]]]:
        if self._layouts is None:
            if self._graph is None:
                raise LogicError("GraphExec.kernel_node_set_params: the node's kernel is unknown "
                                 "here; pass func=")
            self._layouts = {node.index: (node.function_name, node.param_layout)
                             for node in self._graph.get_nodes() if node.type == "kernel"}
        layout = self._layouts.get(index)
        if layout is None:
            # The daemon names what is wrong (no such node, not a kernel node).
            return f"node {index}", []
        return layout

    def kernel_node_set_params(self, *args: Any, kernel_node: Any,
                               func: Optional["Function"] = None, block: Any = (),
                               grid: Any = (), shared: Optional[int] = None) -> None:
        """Sets the arguments (and optionally the kernel, dimensions and dynamic shared memory)
        of one kernel node for later launches (``cuGraphExecKernelNodeSetParams``).

        ``args`` follow a kernel call's rules (numpy scalars, device allocations; not
        ``In``/``Out``/``InOut``). ``kernel_node`` is a :class:`GraphNode` or its index;
        ``func`` another kernel (default: the node's); an empty ``block``/``grid`` or
        ``shared=None`` keeps the node's. Checked by the daemon exactly like a launch.
        """
        index = int(kernel_node)
        label = "GraphExec.kernel_node_set_params"
        if func is not None:
            name, params = func.name, func.param_layout
        else:
            name, params = self._node_layout(index)
        parts = []
        for i, arg in enumerate(args):
            packed = _pack_arg(i, arg)
            if packed is None:
                raise LogicError(f"{label}: parameter #{i} is {type(arg).__name__}; In/Out/InOut "
                                 "arguments cannot be set on a graph node, pass device memory",
                                 code=grpc.StatusCode.INVALID_ARGUMENT, operation=label)
            parts.append(packed)
        request = _ex.SetGraphExecKernelNodeArgsRequest(graph_exec_id=self.handle,
                                                        node_index=index)
        if params or not parts:
            if len(parts) != len(params):
                raise LogicError(f"{label}: {name} takes {len(params)} parameters, "
                                 f"{len(parts)} given", code=grpc.StatusCode.INVALID_ARGUMENT,
                                 operation=label)
            blob = bytearray(max((o + n for o, n in params), default=0))
            for i, (part, (offset, size)) in enumerate(zip(parts, params)):
                if len(part) != size:
                    raise LogicError(f"{label}: {name}: parameter #{i} (0-based) takes {size} "
                                     f"bytes in the kernel, but the argument is "
                                     f"{_describe(args[i])} of {len(part)} bytes",
                                     code=grpc.StatusCode.INVALID_ARGUMENT, operation=label)
                blob[offset:offset + size] = part
            request.packed_args = bytes(blob)
        else:
            request.packed_args = b"".join(parts)  # the daemon says what is wrong
        if func is not None:
            request.function_id = func.handle
        if not _keeps(block):
            request.block.CopyFrom(_core.dim3(block, "block"))
        if not _keeps(grid):
            request.grid.CopyFrom(_core.dim3(grid, "grid"))
        if shared is not None:
            request.shared_memory_bytes = int(shared)
        _graph_call(self._core, "ExecutionService.SetGraphExecKernelNodeArgs", request, label)
        if func is not None and self._layouts is not None:
            self._layouts[index] = (func.name, func.param_layout)

    def __repr__(self) -> str:
        return f"<gpurpc.driver.GraphExec {self.handle}>"


# gpurpc.driver re-exports these, under its name: class reprs, help() and pickle say
# gpurpc.driver.X, as before it was split into modules.
for _name in __all__:
    globals()[_name].__module__ = "gpurpc.driver"
del _name
