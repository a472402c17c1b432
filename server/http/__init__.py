"""The manager's HTTP edge: the FastAPI app (`app`), the OpenAI-compatible routes (`openai_api`, serving
in `openai_answer`), the live view (`ui`), and the engine registration routes' checks."""
