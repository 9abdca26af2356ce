//! `mlxhost-componentize CORE.wasm OUT.wasm`: turns a core module that
//! carries wit-bindgen's component-type section into a component, with the
//! `wit-component` library (the same encoding as `wasm-tools component new`,
//! without installing the CLI). Used by `scripts/build-plugins.sh`.

use anyhow::Context;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [input, output] = args.as_slice() else {
        anyhow::bail!("usage: mlxhost-componentize CORE.wasm OUT.wasm");
    };
    let core = std::fs::read(input).with_context(|| format!("reading {input}"))?;
    let component = wit_component::ComponentEncoder::default()
        .module(&core)
        .with_context(|| format!("{input}: not a wit-bindgen core module"))?
        .validate(true)
        .encode()
        .with_context(|| format!("{input}: encoding the component"))?;
    let tmp = format!("{output}.tmp");
    std::fs::write(&tmp, component).with_context(|| format!("writing {tmp}"))?;
    std::fs::rename(&tmp, output).with_context(|| format!("writing {output}"))?;
    Ok(())
}
