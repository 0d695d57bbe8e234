"""Reading and writing checkpoints of other formats: `hf` (Hugging Face safetensors load and save),
`hf_config` (config.json <-> our config), `hf_files` (the safetensors files), `tokenizer` and
`tokenizer_tiktoken` (tokenizers of those checkpoints). Importers name the submodule."""
