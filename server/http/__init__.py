"""The manager's HTTP edge: the FastAPI app (`app`), the OpenAI-compatible routes (`openai_api`; whole
answers in `openai_answer`, streamed ones in `openai_stream`), the live view (`ui`), and the engine
registration routes' checks."""
