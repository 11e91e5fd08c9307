"""Adapters that plug BubbleSpec into existing RL trainers (docs/INTEGRATIONS.md).

Each adapter is a module with its own optional extra, imported by name so that importing this
package pulls in no trainer framework:

* ``bubblespec.integrations.trl`` (``pip install 'bubblespec[trl]'``): a ``TrainerCallback``
  that announces the next steps' prompts for drafting, and a directory-based weight sync for
  TRL's ``vllm_mode="server"`` where NCCL is absent.
"""
