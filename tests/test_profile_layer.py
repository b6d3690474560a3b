"""benchmarks/profile_layer.py reads GPU kernels out of a trace as XLA writes it (hand-written trace)."""

from benchmarks import profile_layer

TRACE = {"traceEvents": [
    {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
    {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #13(Compute)"}},
    {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "XLA Ops"}},
    {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
    {"ph": "M", "pid": 2, "tid": 9, "name": "thread_name", "args": {"name": "python"}},
    # Two calls of: gemm (10 us), gap 5 us, fusion (4 us, overlapping a 2 us copy on the same line).
    *[e for base in (0.0, 100.0) for e in (
        {"ph": "X", "pid": 1, "tid": 7, "ts": base, "dur": 10.0, "name": "gate_up_kernel", "args": {"hlo_op": "custom-call.1"}},
        {"ph": "X", "pid": 1, "tid": 7, "ts": base + 15.0, "dur": 4.0, "name": "loop_fusion", "args": {"hlo_op": "fusion.3"}},
        {"ph": "X", "pid": 1, "tid": 7, "ts": base + 16.0, "dur": 2.0, "name": "copy", "args": {"hlo_op": "copy.2"}},
        {"ph": "X", "pid": 1, "tid": 8, "ts": base, "dur": 19.0, "name": "custom-call.1"},  # summary line: not counted
        {"ph": "X", "pid": 2, "tid": 9, "ts": base, "dur": 50.0, "name": "PjitFunction"},  # host: not counted
    )],
]}


def test_kernels_come_from_the_gpu_stream_lines_only():
    kernels = profile_layer.gpu_kernels(TRACE)
    assert sorted({k["name"] for k in kernels}) == ["copy", "gate_up_kernel", "loop_fusion"]
    assert len(kernels) == 6


def test_span_busy_and_table_per_call():
    s = profile_layer.summarize(profile_layer.gpu_kernels(TRACE), calls=2)
    assert s["kernels_per_call"] == 3
    assert s["span_us"] == (119.0 - 0.0) / 2  # first start to last end, over both calls
    assert s["busy_us"] == 14.0  # 10 + 4: the copy runs inside the fusion's interval
    assert [(r["kernel"], r["hlo_op"], r["us_per_call"]) for r in s["table"]] == [
        ("gate_up_kernel", "custom-call.1", 10.0), ("loop_fusion", "fusion.3", 4.0), ("copy", "copy.2", 2.0)]
    assert profile_layer.summarize([], calls=2)["table"] == []


def test_the_heading_says_in_words_when_the_shared_expert_goes_through_the_kernels():
    # Plan.shared_kernel_max_tokens: None is every size (the heading once said "up to None tokens")
    assert profile_layer._shared_kernel_limit(None) == "through the kernels at every size"
    assert profile_layer._shared_kernel_limit(0) == "dense (never through the kernels)"
    assert profile_layer._shared_kernel_limit(1024) == "through the kernels up to 1024 tokens"


HLO = """HloModule jit__lambda_
%fused_computation (param_0: bf16[8,4]) -> bf16[4,8] {
  ROOT %transpose.1 = bf16[4,8]{1,0} transpose(%param_0), dimensions={1,0}
}
ENTRY %main (x: bf16[8,4]) -> bf16[4,8] {
  %x = bf16[8,4]{1,0} parameter(0)
  %loop_select_transpose_fusion.2 = bf16[4,8]{1,0} fusion(bf16[8,4]{1,0} %x), kind=kLoop, calls=%fused_computation, metadata={op_name="jit(<lambda>)/moe_jax.combine/transpose" source_file="a.py" source_line=3}
  ROOT %input_reduce_fusion = f32[4]{0} fusion(%loop_select_transpose_fusion.2), kind=kInput, calls=%fused_reduce
}
"""


def test_fusions_are_named_as_their_kernels_with_the_jax_op_they_come_from():
    sources = profile_layer.fusion_sources(HLO)
    assert sources == {
        "loop_select_transpose_fusion_2": {"shape": "bf16[4,8]{1,0}", "kind": "kLoop",
                                           "op_name": "jit(<lambda>)/moe_jax.combine/transpose"},
        "input_reduce_fusion": {"shape": "f32[4]{0}", "kind": "kInput", "op_name": ""}}


def test_a_compiled_layer_names_its_fusions():
    # the small preset on this machine's backend: every fusion XLA made has a kind and a shape
    import jax
    import moe_jax

    config = profile_layer.config_for("small", "bf16", "xla")
    plan = moe_jax.resolve(config, None)
    params = moe_jax.random_params(config, jax.random.key(0), plan)
    x = jax.numpy.ones((8, config.hidden_size), jax.numpy.bfloat16)
    text = jax.jit(lambda p, x: moe_jax.moe_forward(p, x, plan)[0]).lower(params, x).compile().as_text()
    sources = profile_layer.fusion_sources(text)
    assert len(sources) == text.count(" fusion(") > 0
    assert any("moe_jax" in s["op_name"] or "jit(" in s["op_name"] for s in sources.values()), sources
