"""The default bench suites (`layerkv bench` with no suite named), each a module with
`run(options, progress) -> SuiteResult`: layerkv's own data path and costs measured in this
process against the embedded store or a local Mooncake pool, no vLLM, no root.

    datapath     layerwise vs whole-object vs memcpy: the same bytes moved three ways
    plans        the worker's load / save plans vs whole-object reads and writes
    descriptors  one layer's range-call lists: range templates vs a per-block Python loop
    lookup       scheduler hit queries: windowed exists vs one query over every block
    objects      objects, keys, sessions and store calls per step: per block vs per layer
    overlap      time to first token on the reference engine: transfer hidden behind compute
    overlap_rig  its rig: the reference engine over a pool holding the prompt's prefix (also
                 suite network's consumer host)
    scale        layerkv's own cost as prompts and layers grow
"""
