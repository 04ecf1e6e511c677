import asyncio

from verifiers.v1.errors import SandboxError

from harnessd.verifiers import ExecdConfig, ExecdRuntime


async def main() -> None:
    # A local execd; or ExecdConfig(prefix=["ssh", "host"], quote_for_remote_shell=True),
    # or ExecdConfig(prefix=["ip", "netns", "exec", "ws"], bind_host=..., connect_host=...).
    runtime = ExecdRuntime(ExecdConfig())
    await runtime.start()
    try:
        # What a task's setup, a harness and a reward do through any verifiers runtime;
        # `await vf.Agent(config).run(task, runtime=runtime)` borrows it the same way.
        await runtime.write("task/answer.txt", b"42\n")  # parents are created
        result = await runtime.run(["sh", "-c", "cat task/answer.txt; exit 3"], {})
        assert (result.exit_code, result.stdout) == (3, "42\n")

        await runtime.run_background(["sh", "-c", "echo ready; sleep 600"], {}, "server.log")
        while b"ready" not in await runtime.read("server.log"):
            await asyncio.sleep(0.05)

        try:
            await runtime.read("task/answer.txt", max_bytes=1)  # execd sends at most 2 bytes
        except SandboxError as exc:
            print(f"capped read: {exc}")
    finally:
        await runtime.stop()  # the background server and anything it left behind are gone
    print("verifiers runtime: ok")


asyncio.run(main())
