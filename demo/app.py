"""The vtoken Gradio demo: `python demo/app.py [--model M] [--host H] [--port P] [--share]`, the same app as
`vtoken demo` (the app lives in the package, `vtoken/demo/`, so `pip install vtoken[demo]` ships it)."""

from vtoken.demo import main

if __name__ == "__main__":
    main()
