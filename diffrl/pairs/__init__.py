"""Preference pairs — a prompt, two images and which one is preferred — in one package, a module per role:

- `diffrl.pairs.labels`: the label file (JSONL, one pair a line) — its format, strict reading, the checks of a
  file's chains against a pipeline, and `diffrl pairs sample`, which draws pairs to label (D3PO; the demo's Label
  page reads and writes the same file);
- `diffrl.pairs.datasets`: preference-pair datasets for offline trainers (Diffusion-DPO, SePPO) named by one string:
  a label file, Pick-a-Pic parquet files, or a ShapesWorld set;
- `diffrl.pairs.shapes`: the ShapesWorld sets, tiny-shapes samples ranked by a reward and written as label files.

The package sits above `diffrl.training` and below the trainers; its modules import one another only downward
(datasets -> labels, shapes).
"""
