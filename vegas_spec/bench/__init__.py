"""`vegas bench` and `vegas tune`: methods measured side by side on the user's model, prompts
and hardware, and the paper's three-step tuning of γ and the sparsity ratio.

`options` turns command-line values into a checked plan (before any model loads),
`workloads` builds the prompts, `runner` runs the cells and keeps `results.json`,
`analysis` derives speedups, losslessness and needle retrieval from the cells, `plots` and
`report` write the PNG figures and `report.md`, `tune` runs the three steps, `commands` ties
them together for the command line."""
