"""The streamvqa worker: takes sessions from Redis, decodes their video, runs the engine."""
