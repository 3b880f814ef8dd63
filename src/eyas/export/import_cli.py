"""Read an EAGLE-3 or DFlash drafter trained elsewhere into an eyas checkpoint, so `eyas eval` can score it.

Understood: official EAGLE-3 (SafeAILab), SpecForge / SGLang, vLLM and speculators
(Eagle3Speculator, and its DFlash drafters) folders, and eyas's own exports. Layer ids are converted to eyas's
convention (id k = input of target layer k): SGLang's `eagle_config` ids get +1; a folder
without ids gets the engines' default (2, N/2, N-3). The EAGLE 3.1 options fc_norm and
norm_output are kept; anything eyas's drafter does not implement (norm_before_fc, biases,
tied lm_head, several layers, a non-Llama layer, embeddings unlike the target's; a DFlash
drafter's sample_from_anchor) is refused with the field that says so.

examples:
  eyas import downloads/EAGLE3-LLaMA3.1-Instruct-8B --target meta-llama/Llama-3.1-8B-Instruct --out runs/eagle3
  eyas import exported/sglang --out runs/back        # an eyas export knows its target
"""

from __future__ import annotations

import importlib

from eyas.export.config import ImportConfig

HELP = "EAGLE-3 or DFlash drafter from elsewhere -> an eyas checkpoint"
CONFIG = ImportConfig  # its options (eyas.options)


def run(cfg: ImportConfig) -> int:
    import_drafter = importlib.import_module("eyas.export.importer").import_drafter

    s = import_drafter(cfg.dir, cfg.out, target=cfg.target, force=cfg.force)
    print(f"imported {cfg.dir} ({s['layout']}) to {s['out']}: target {s['target']}, "
          f"aux layer ids {s['aux_layer_ids']} (input of layer k), draft vocabulary {s['draft_vocab_size']}, "
          f"embed_tokens {s['embed_tokens']}, drafting {s['depth']} tokens a step")
    return 0
