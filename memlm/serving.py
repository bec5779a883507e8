"""`memlm serve`: 🤗's own OpenAI-compatible server (`transformers serve`) for memlm's checkpoints.

`transformers serve` runs the requests (/v1/completions, /v1/chat/completions, /v1/responses, /v1/models, /health,
streaming or not; `transformers chat` talks to it); memlm changes one thing, how it loads a model. 🤗's loader
(`transformers/cli/serving/model_manager.py`, 5.21 to 5.24) takes the class that a checkpoint's config names in
`architectures` from the `transformers` module, where memlm's classes are not: memlm's model manager loads memlm's
checkpoints with `AutoModelForCausalLM`, which memlm registers with, and leaves every other checkpoint to 🤗's loader.
The installed memlm's code runs, also for a checkpoint that carries its own (remote code) and with
`--trust-remote-code`: 🤗's Auto classes prefer classes registered in the process to a checkpoint's code.

Continuous batching (`--continuous-batching`) needs a paged key-value cache, which memlm's memories are not: memlm's
models do not offer it (`DeclinesContinuousBatching`), and serve falls back to `generate` for them.
"""

import importlib.util
import inspect
import os

from transformers.utils import logging

logger = logging.get_logger(__name__)

# What `transformers serve` imports (🤗's `is_serve_available`), and `transformers chat` beside it: the `serve` extra.
SERVE_EXTRA_NEEDED = ("fastapi", "uvicorn", "pydantic", "openai", "rich")

HELP = (
    "memlm's checkpoints (and any other 🤗 model) behind 🤗's OpenAI-compatible server: `transformers serve` with "
    "memlm's models loadable. Give a checkpoint folder (or Hub repository) to serve it alone; without one, each "
    "request's `model` names the checkpoint to load. Endpoints: /v1/completions, /v1/chat/completions, /v1/responses "
    "(streaming or not), /v1/models, /health. Every option is transformers serve's."
)


def check_serving_extra() -> None:
    """A one-line error naming what is missing when the `serve` extra is not installed."""
    missing = [name for name in SERVE_EXTRA_NEEDED if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(
            f"memlm serve needs the serve extra, and {', '.join(map(repr, missing))} "
            f"{'is' if len(missing) == 1 else 'are'} not installed: pip install 'memlm[serve]'."
        )


def check_checkpoint(name: str) -> None:
    """A clear error for what `memlm serve CHECKPOINT` cannot serve: a folder without config.json or a tokenizer, or a
    name that is neither a folder nor a Hub repository (🤗 would take it for a malformed repository id)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    from transformers.cli.serving.utils import split_model_id

    from .checkpoint_files import check_tokenizer, checkpoint_folder

    if os.path.isdir(name):
        check_tokenizer(checkpoint_folder(name)[0])
        return
    try:
        validate_repo_id(split_model_id(name)[0].partition("@")[0])
    except HFValidationError:
        raise FileNotFoundError(
            f"the folder {name!r} does not exist (nor is it a Hub repository id): give a folder written by "
            "save_pretrained, with its tokenizer, or a Hub repository."
        ) from None


def split_model_name(name: str) -> tuple[str, str | None]:
    """The folder or Hub repository and the revision of a name serve's model manager gives its loader: a local
    folder is the whole name (🤗 5.21 appends `@main` to it, 5.24 does not), a Hub repository is `repo@revision`."""
    if os.path.isdir(name):
        return name, None
    repository, _, revision = name.rpartition("@")
    return (repository, revision or None) if repository else (name, None)


def memlm_model_manager():
    """serve's `ModelManager` with memlm's checkpoints loaded through `AutoModelForCausalLM`."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.cli.serving.model_manager import ModelManager

    import memlm  # noqa: F401  (registers memlm's classes with the Auto classes)
    from memlm.configuration.validation import MEMLM_MODEL_TYPES

    class MemlmModelManager(ModelManager):
        def _load_model(self, model_id_and_revision: str, tqdm_class=None, progress_callback=None, gguf_file=None):
            model_id, revision = split_model_name(model_id_and_revision)
            config = AutoConfig.from_pretrained(model_id, revision=revision, trust_remote_code=self.trust_remote_code)
            if config.model_type not in MEMLM_MODEL_TYPES:
                return super()._load_model(model_id_and_revision, tqdm_class=tqdm_class,
                                           progress_callback=progress_callback, gguf_file=gguf_file)  # fmt: skip
            if progress_callback is not None:
                progress_callback({"status": "loading", "model": model_id_and_revision, "stage": "weights"})
            options = {"quantization_config": self.get_quantization_config()} if self.quantization else {}
            model = AutoModelForCausalLM.from_pretrained(
                model_id, revision=revision, dtype=self.dtype, device_map=self.device, tqdm_class=tqdm_class,
                trust_remote_code=self.trust_remote_code, **options,
            )  # fmt: skip
            if model.generation_config.eos_token_id is None:
                logger.warning(
                    f"{model_id} has no eos_token_id in its generation config: its answers run to max_tokens (serve "
                    "asks for at least 1024 unless the request says). Give its config the tokenizer's end of text "
                    "(eos_token_id=tokenizer.eos_token_id) and save it again."
                )
            return model

    return MemlmModelManager


def serve(argv: list[str]) -> None:
    """Run `transformers serve` with `argv` (its own options: `memlm serve --help` lists them) and memlm's model
    manager."""
    check_serving_extra()
    from huggingface_hub import typer_factory
    from transformers.cli.serve import Serve

    def serve_memlm_models(**options):
        from transformers.cli.serving import model_manager

        if options["force_model"] is not None:
            check_checkpoint(options["force_model"])
        # Serve builds its manager from this module's `ModelManager` when it starts: from here on, this process's
        # serve loads memlm's checkpoints. Nothing else changes.
        model_manager.ModelManager = memlm_model_manager()
        Serve(**options)

    # serve's options, read from its signature as the `transformers` command reads them (huggingface_hub's command
    # framework: --help, and a bad option as its usage line with exit status 2); the errors of loading a model reach
    # `memlm`'s one-line errors.
    serve_memlm_models.__signature__ = inspect.signature(Serve)
    application = typer_factory(help=HELP)
    application.command(name="serve", help=HELP)(serve_memlm_models)
    application(["serve", *argv], prog_name="memlm")
