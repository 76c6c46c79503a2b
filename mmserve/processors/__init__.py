"""Between a request and the engine: tokenizers, chat templates, streaming detokenisation.

Modules (imported directly; this package imports nothing so that it stays cheap):
- tokenizer: load_tokenizer (HF folder or GGUF), eos_token_ids, vocab_size
- chat_template: render_chat, render_and_tokenize, message/tool/template_kwargs validation
- time_limit: call_with_time_limit, the deadline a chat template's render runs under
- detokenizer: IncrementalDetokenizer (DecodeStream + stop strings) -> DetokOutput
- stop_strings: StopStringMatcher, chunking-independent stop-string matching
"""
