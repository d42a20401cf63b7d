"""CUDA graphs through the Python client: Stream.begin_capture/end_capture, Graph,
GraphExec (PyCUDA's names), against a real daemon.

The kernels are the fake backend's (kernels.FAKE_KERNELS), whose fake replays a graph's
operations with the same checks as the operations themselves, so these tests run in CI on
the fake backend and unchanged on a GPU.
"""
from __future__ import annotations

import gc

import grpc
import numpy as np
import pytest

import gpurpc.driver as cuda
from gpurpc.compiler import SourceModule
from gpurpc.v1 import execution_service_pb2 as ex

from kernels import FAKE_KERNELS

N = 256


@pytest.fixture
def mod(ctx: cuda.Context) -> SourceModule:
    return SourceModule(FAKE_KERNELS)


def zeros(n: int = N, dtype=np.float32) -> cuda.DeviceAllocation:
    return cuda.to_device(np.zeros(n, dtype))


def read(buf: cuda.DeviceAllocation, n: int = N, dtype=np.float32) -> np.ndarray:
    out = np.empty(n, dtype)
    cuda.memcpy_dtoh(out, buf)
    return out


def n64(value: int) -> np.uint64:
    return np.uint64(value)


# -- capture and replay -----------------------------------------------------------------------

def test_hundred_captured_kernels_replay_with_one_launch(mod: SourceModule,
                                                         ctx: cuda.Context) -> None:
    add_one = mod.get_function("add_one_f32")
    stream = cuda.Stream()
    data = zeros()
    assert not stream.is_capturing()
    stream.begin_capture()
    assert stream.is_capturing()
    assert stream.get_capture_status() == cuda.capture_status.ACTIVE
    for _ in range(100):
        add_one(data, n64(N), block=(N, 1, 1), stream=stream)
    graph = stream.end_capture()
    assert not stream.is_capturing()
    assert graph.node_count == 100
    assert (read(data) == 0).all()  # captured, not run

    nodes = graph.get_nodes()
    assert len(nodes) == 100
    assert [n.index for n in nodes] == list(range(100))
    assert {n.type for n in nodes} == {"kernel"}
    assert nodes[7].function_name == "add_one_f32"
    assert nodes[7].function_id == add_one.handle
    assert nodes[7].param_layout == add_one.param_layout
    assert nodes[7].block == (N, 1, 1) and nodes[7].grid == (1, 1, 1)

    exe = graph.instantiate()
    exe.launch(stream)
    exe.launch(stream)
    stream.synchronize()
    assert (read(data) == 200).all()
    exe.launch()  # the default stream
    ctx.synchronize()
    assert (read(data) == 300).all()


def test_memsets_and_copies_are_captured_too(mod: SourceModule) -> None:
    stream = cuda.Stream()
    a = zeros(dtype=np.uint32)
    b = zeros(dtype=np.uint32)
    stream.begin_capture(cuda.capture_mode.RELAXED)
    cuda.memset_d32_async(a, 7, N, stream)
    cuda.memcpy_dtod_async(b, a, 4 * N, stream)
    graph = stream.end_capture()
    assert [n.type for n in graph.get_nodes()] == ["memset", "memcpy"]
    assert (read(a, dtype=np.uint32) == 0).all()
    exe = graph.instantiate()
    exe.launch(stream)
    stream.synchronize()
    assert (read(b, dtype=np.uint32) == 7).all()


def test_a_pitched_copy_on_a_capturing_stream_is_captured_row_by_row(
        mod: SourceModule) -> None:
    """A graph takes plain copies only: a Memcpy2D between device pitches, one 3D copy
    elsewhere, becomes one copy node per row while its stream captures, and the graph's
    replay copies the rows."""
    h, w, pitch = 6, 12, 32
    src = cuda.to_device(np.arange(h * pitch, dtype=np.uint8))
    dst = cuda.to_device(np.zeros(h * pitch, np.uint8))
    copy = cuda.Memcpy2D()
    copy.set_src_device(src)
    copy.set_dst_device(dst)
    copy.src_pitch = copy.dst_pitch = pitch
    copy.width_in_bytes, copy.height = w, h
    stream = cuda.Stream()
    stream.begin_capture(cuda.capture_mode.RELAXED)
    copy(stream)
    graph = stream.end_capture()
    assert [n.type for n in graph.get_nodes()] == ["memcpy"] * h
    assert not read(dst, h * pitch, np.uint8).any()  # captured, not run
    exe = graph.instantiate()
    exe.launch(stream)
    stream.synchronize()
    want = np.zeros((h, pitch), np.uint8)
    want[:, :w] = np.arange(h * pitch, dtype=np.uint8).reshape(h, pitch)[:, :w]
    assert np.array_equal(read(dst, h * pitch, np.uint8).reshape(h, pitch), want)
    # After the capture the same copy is one 3D copy again, and runs at once.
    cuda.memset_d8(dst, 0, h * pitch)
    copy(stream)
    stream.synchronize()
    assert np.array_equal(read(dst, h * pitch, np.uint8).reshape(h, pitch), want)


def test_a_non_blocking_capture_leaves_the_default_stream_usable(mod: SourceModule) -> None:
    fill = mod.get_function("fill_u32")
    stream = cuda.Stream(cuda.stream_flags.NON_BLOCKING)
    data = zeros(dtype=np.uint32)
    stream.begin_capture()
    fill(data, np.uint32(3), n64(N), block=(N, 1, 1), stream=stream)
    fill(data, np.uint32(1), n64(4), block=(4, 1, 1))  # stream 0: runs now
    head = np.empty(4, np.uint32)
    cuda.memcpy_dtoh(head, data)
    assert (head == 1).all()
    exe = stream.end_capture().instantiate()
    exe.launch(stream)
    stream.synchronize()
    assert (read(data, dtype=np.uint32) == 3).all()


# -- update and kernel node parameters ----------------------------------------------------------

def _fill_graph(fill: cuda.Function, stream: cuda.Stream, buf, value: int) -> cuda.Graph:
    stream.begin_capture()
    fill(buf, np.uint32(value), n64(N), block=(N, 1, 1), stream=stream)
    return stream.end_capture()


def test_update_takes_another_graphs_parameters(mod: SourceModule) -> None:
    fill = mod.get_function("fill_u32")
    stream = cuda.Stream()
    a, b = zeros(dtype=np.uint32), zeros(dtype=np.uint32)
    exe = _fill_graph(fill, stream, a, 1).instantiate()
    exe.update(_fill_graph(fill, stream, b, 2))
    exe.launch(stream)
    stream.synchronize()
    assert (read(a, dtype=np.uint32) == 0).all()
    assert (read(b, dtype=np.uint32) == 2).all()

    stream.begin_capture()
    cuda.memset_d32_async(a, 5, N, stream)
    cuda.memset_d32_async(a, 6, N, stream)
    two = stream.end_capture()
    with pytest.raises(cuda.LogicError, match="same topology") as info:
        exe.update(two)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    exe.launch(stream)  # unchanged, and the session is fine
    stream.synchronize()


def test_kernel_node_set_params(mod: SourceModule) -> None:
    fill = mod.get_function("fill_u32")
    add_one = mod.get_function("add_one_f32")
    stream = cuda.Stream()
    data = zeros(dtype=np.uint32)
    graph = _fill_graph(fill, stream, data, 5)
    node = graph.get_nodes()[0]
    exe = graph.instantiate()
    exe.kernel_node_set_params(data, np.uint32(9), n64(N), kernel_node=node)
    exe.launch(stream)
    stream.synchronize()
    assert (read(data, dtype=np.uint32) == 9).all()

    # Only the first 8 elements, by the node's index and new dimensions.
    exe.kernel_node_set_params(data, np.uint32(4), n64(8), kernel_node=0, block=(8, 1, 1))
    exe.launch(stream)
    stream.synchronize()
    out = read(data, dtype=np.uint32)
    assert (out[:8] == 4).all() and (out[8:] == 9).all()

    # Another kernel for the node.
    floats = zeros()
    exe.kernel_node_set_params(floats, n64(N), kernel_node=node, func=add_one, block=(N, 1, 1))
    exe.launch(stream)
    exe.launch(stream)
    stream.synchronize()
    assert (read(floats) == 2).all()
    # Its layout is remembered for later calls without func=.
    exe.kernel_node_set_params(floats, n64(4), kernel_node=node, block=(4, 1, 1))
    exe.launch(stream)
    stream.synchronize()
    out = read(floats)
    assert (out[:4] == 3).all() and (out[4:] == 2).all()


def test_kernel_node_set_params_checks_like_a_launch(mod: SourceModule) -> None:
    fill = mod.get_function("fill_u32")
    stream = cuda.Stream()
    data = zeros(dtype=np.uint32)
    stream.begin_capture()
    fill(data, np.uint32(5), n64(N), block=(N, 1, 1), stream=stream)
    cuda.memset_d32_async(data, 1, 4, stream)
    graph = stream.end_capture()
    exe = graph.instantiate()
    with pytest.raises(cuda.LogicError, match="parameter #1"):
        exe.kernel_node_set_params(data, np.uint64(9), n64(N), kernel_node=0)
    with pytest.raises(cuda.LogicError, match="3 parameters, 2 given"):
        exe.kernel_node_set_params(data, np.uint32(9), kernel_node=0)
    with pytest.raises(cuda.LogicError, match="not a kernel node"):
        exe.kernel_node_set_params(data, np.uint32(9), n64(N), kernel_node=1, func=fill)
    with pytest.raises(cuda.LogicError, match="past the 2 nodes"):
        exe.kernel_node_set_params(data, np.uint32(9), n64(N), kernel_node=5, func=fill)
    with pytest.raises(cuda.LogicError, match="block.x"):
        exe.kernel_node_set_params(data, np.uint32(9), n64(N), kernel_node=0, block=(4096, 1, 1))
    with pytest.raises(cuda.LogicError, match="In/Out/InOut"):
        exe.kernel_node_set_params(cuda.In(np.zeros(4, np.uint32)), np.uint32(9), n64(N),
                                   kernel_node=0)
    exe.launch(stream)
    stream.synchronize()
    out = read(data, dtype=np.uint32)
    assert (out[:4] == 1).all() and (out[4:] == 5).all()


# -- misuse -------------------------------------------------------------------------------------

def test_capture_misuse_raises_logic_errors_and_the_session_goes_on(mod: SourceModule,
                                                                     ctx: cuda.Context) -> None:
    fill = mod.get_function("fill_u32")
    stream = cuda.Stream()
    data = zeros(dtype=np.uint32)
    with pytest.raises(cuda.LogicError, match="not capturing"):
        stream.end_capture()
    with pytest.raises(cuda.LogicError, match="mode 7"):
        stream.begin_capture(7)
    stream.begin_capture()
    with pytest.raises(cuda.LogicError, match="already capturing"):
        stream.begin_capture()
    fill(data, np.uint32(2), n64(N), block=(N, 1, 1), stream=stream)
    with pytest.raises(cuda.LogicError, match="capturing a graph") as info:
        stream.synchronize()
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(cuda.LogicError, match="capturing a graph"):
        ctx.synchronize()
    # A blocking stream captures: the default stream is off limits.
    with pytest.raises(cuda.LogicError, match="non_blocking"):
        read(data, dtype=np.uint32)
    graph = stream.end_capture()  # the capture went on
    assert graph.node_count == 1
    assert ctx.state == "active"
    exe = graph.instantiate()
    exe.launch(stream)
    stream.synchronize()
    assert (read(data, dtype=np.uint32) == 2).all()


def test_refused_queued_work_raises_at_the_next_drain(mod: SourceModule) -> None:
    stream = cuda.Stream()
    event = cuda.Event()
    stream.begin_capture()
    event.record(stream)  # queued; the daemon refuses it
    with pytest.raises(cuda.LogicError, match="RecordEvent.*capturing a graph"):
        stream.end_capture()
    graph = stream.end_capture()
    assert graph.node_count == 0
    graph.instantiate().launch(stream)  # an empty graph runs
    stream.synchronize()


def test_unknown_and_foreign_ids_are_logic_errors(mod: SourceModule, ctx: cuda.Context) -> None:
    fill = mod.get_function("fill_u32")
    stream = cuda.Stream()
    data = zeros(dtype=np.uint32)
    graph = _fill_graph(fill, stream, data, 1)
    exe = graph.instantiate()
    core = ctx._core
    for name, request in [
            ("ExecutionService.InstantiateGraph", ex.InstantiateGraphRequest(graph_id=12345)),
            ("ExecutionService.LaunchGraph", ex.LaunchGraphRequest(
                launch=ex.LaunchGraphCommand(graph_exec_id=12345))),
            ("ExecutionService.GetGraphNodes", ex.GetGraphNodesRequest(graph_id=exe.handle)),
            ("ExecutionService.DestroyGraphExec",
             ex.DestroyGraphExecRequest(graph_exec_id=graph.handle)),
            ("ExecutionService.BeginCapture", ex.BeginCaptureRequest(stream_id=12345))]:
        with pytest.raises(cuda.LogicError) as info:
            core.call(name, request)
        assert info.value.code == grpc.StatusCode.NOT_FOUND, name
    with pytest.raises(cuda.LogicError, match="legacy default stream"):
        core.call("ExecutionService.BeginCapture", ex.BeginCaptureRequest(stream_id=0))

    other = cuda.Device(0).make_context()
    try:
        with pytest.raises(cuda.LogicError) as info:
            other._core.call("ExecutionService.LaunchGraph", ex.LaunchGraphRequest(
                launch=ex.LaunchGraphCommand(graph_exec_id=exe.handle)))
        assert info.value.code == grpc.StatusCode.NOT_FOUND
    finally:
        cuda.Context.pop()
        other.detach()
    exe.launch(stream)
    stream.synchronize()
    assert (read(data, dtype=np.uint32) == 1).all()


def test_garbage_collected_graphs_are_freed(mod: SourceModule, ctx: cuda.Context) -> None:
    fill = mod.get_function("fill_u32")
    stream = cuda.Stream()
    data = zeros(dtype=np.uint32)
    graph = _fill_graph(fill, stream, data, 1)
    exe = graph.instantiate()
    ids = (graph.handle, exe.handle)
    del graph, exe
    gc.collect()
    ctx.synchronize()  # processes the releases
    with pytest.raises(cuda.LogicError, match="no graph"):
        ctx._core.call("ExecutionService.GetGraphNodes", ex.GetGraphNodesRequest(graph_id=ids[0]))
    with pytest.raises(cuda.LogicError, match="no graph exec"):
        ctx._core.call("ExecutionService.LaunchGraph", ex.LaunchGraphRequest(
            launch=ex.LaunchGraphCommand(graph_exec_id=ids[1])))


def test_a_replay_on_freed_memory_faults_the_session(mod: SourceModule, ctx: cuda.Context,
                                                     is_fake: bool) -> None:
    if not is_fake:
        pytest.skip("freed device memory need not fault on a GPU; the fake checks every access")
    fill = mod.get_function("fill_u32")
    stream = cuda.Stream()
    data = zeros(dtype=np.uint32)
    exe = _fill_graph(fill, stream, data, 1).instantiate()
    data.free()
    exe.launch(stream)
    with pytest.raises(cuda.LaunchError) as info:
        stream.synchronize()
    assert info.value.code == grpc.StatusCode.ABORTED
