//! `ferry store`: Ferry's own TCPStore server, and a client for any TCPStore server
//! (Ferry's or `torch.distributed.TCPStore`) to look at what agents published.

use std::io::Write;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Subcommand};
use ferry::exchange::tcpstore::{serve, user_key, ClientOptions, ServerConfig, TcpStoreClient};

/// `ferry store` subcommands.
#[derive(Subcommand, Debug)]
pub enum StoreCmd {
    /// Run Ferry's TCPStore server until Ctrl-C. Limits come from FERRY_TCPSTORE_MAX_*
    /// and FERRY_TCPSTORE_*_TIMEOUT_MS (metadata/exchange/README.md) and are printed at
    /// start.
    Serve(ServeArgs),
    /// Print the value of a key (raw bytes to stdout, or to a file).
    Get(GetArgs),
    /// List the keys the server holds (LIST_KEYS: Ferry's server, torch >= 2.10), as
    /// `get` and `delete` take them.
    List(ListArgs),
    /// Delete a key.
    Delete(KeyArgs),
}

/// `ferry store serve` arguments.
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Where to listen, HOST:PORT; the host may be a name (the first address it
    /// resolves to is used). Port 0 picks a free one.
    #[arg(long, default_value = "127.0.0.1:29500", value_parser = crate::args::host_port)]
    listen: String,
}

/// How to reach a TCPStore server.
#[derive(Args, Debug)]
pub struct ClientArgs {
    /// The server, HOST:PORT (default: FERRY_TCPSTORE_ENDPOINT, else 127.0.0.1:29500).
    #[arg(long, value_parser = crate::args::host_port)]
    endpoint: Option<String>,
    /// Skip the PING after the handshake (servers of torch 2.2-2.4 close on it).
    #[arg(long)]
    no_ping: bool,
    /// Bound on connecting and on every read and write, in seconds.
    #[arg(allow_negative_numbers = true, long, default_value = "5", value_parser = crate::args::seconds)]
    timeout: Duration,
}

/// `ferry store list` arguments.
#[derive(Args, Debug)]
pub struct ListArgs {
    #[command(flatten)]
    client: ClientArgs,
    /// Print the keys as they are on the wire (torch's `/` prefix included), as
    /// `get --raw` and `delete --raw` take them.
    #[arg(long)]
    raw: bool,
}

/// A key on a TCPStore server.
#[derive(Args, Debug)]
pub struct KeyArgs {
    #[command(flatten)]
    client: ClientArgs,
    /// The key as torch's Python API names it (`/` is prepended on the wire, as torch
    /// does), e.g. `ferry/agents/prefill-0/metadata`.
    key: String,
    /// Send the key exactly as given (as `ferry store list --raw` prints keys).
    #[arg(long)]
    raw: bool,
}

/// `ferry store get` arguments.
#[derive(Args, Debug)]
pub struct GetArgs {
    #[command(flatten)]
    key: KeyArgs,
    /// Write the value to this file instead of stdout.
    #[arg(short, long, value_name = "FILE")]
    output: Option<PathBuf>,
}

/// Run one `ferry store` command.
pub fn run(cmd: StoreCmd) -> Result<(), String> {
    match cmd {
        StoreCmd::Serve(a) => store_serve(&a),
        StoreCmd::Get(a) => get(&a),
        StoreCmd::List(a) => list(&a),
        StoreCmd::Delete(a) => delete(&a),
    }
}

/// The first address `host_port` resolves to.
pub fn resolve(host_port: &str) -> Result<SocketAddr, String> {
    host_port
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve '{host_port}': {e}"))?
        .next()
        .ok_or_else(|| format!("'{host_port}' resolves to no address"))
}

fn store_serve(args: &ServeArgs) -> Result<(), String> {
    let listen = resolve(&args.listen)?;
    if listen.ip().is_unspecified() {
        tracing::warn!(
            "listening on every interface ({listen}); the TCPStore protocol has no authentication"
        );
    }
    let config = ServerConfig::default()
        .with_env_overrides()
        .map_err(|e| e.to_string())?;
    let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
    ctrlc::set_handler(move || {
        let _ = stop_tx.send(());
    })
    .map_err(|e| format!("installing the Ctrl-C handler: {e}"))?;
    let server = serve(listen, config.clone()).map_err(|e| e.to_string())?;
    println!(
        "ferry TCPStore server listening on {} (Ctrl-C stops it)",
        server.local_addr()
    );
    print_limits(&config);
    let _ = std::io::stdout().flush();
    // Serve until Ctrl-C (or SIGTERM).
    let _ = stop_rx.recv();
    let keys = server.num_keys();
    server.stop();
    println!("stopped ({keys} keys were stored)");
    Ok(())
}

fn print_limits(c: &ServerConfig) {
    let ms = |d: Duration| d.as_millis();
    println!("limits (FERRY_TCPSTORE_* variables):");
    println!("  max_connections      {}", c.max_connections);
    println!("  idle_timeout_ms      {}", ms(c.idle_timeout));
    println!("  request_timeout_ms   {}", ms(c.request_timeout));
    println!("  park_timeout_ms      {}", ms(c.park_timeout));
    println!("  write_timeout_ms     {}", ms(c.write_timeout));
    println!("  max_key_bytes        {}", c.max_key_bytes);
    println!("  max_value_bytes      {}", c.max_value_bytes);
    println!("  max_keys_per_request {}", c.max_keys_per_request);
    println!("  max_request_bytes    {}", c.max_request_bytes);
    println!("  max_buffered_bytes   {}", c.max_buffered_bytes);
    println!("  max_keys             {}", c.max_keys);
    println!("  max_total_bytes      {}", c.max_total_bytes);
    println!("  max_reply_bytes      {}", c.max_reply_bytes);
    println!("  max_waiters          {}", c.max_waiters);
    println!("  max_waiting_keys     {}", c.max_waiting_keys);
}

fn connect(args: &ClientArgs) -> Result<TcpStoreClient, String> {
    let endpoint = match &args.endpoint {
        Some(e) => e.clone(),
        None => std::env::var("FERRY_TCPSTORE_ENDPOINT")
            .ok()
            .filter(|e| !e.is_empty())
            .unwrap_or_else(|| "127.0.0.1:29500".to_string()),
    };
    let options = ClientOptions {
        io_timeout: args.timeout,
        ping: !args.no_ping,
        ..ClientOptions::default()
    };
    TcpStoreClient::connect(&endpoint, options).map_err(|e| e.to_string())
}

fn wire_key(args: &KeyArgs) -> String {
    if args.raw {
        args.key.clone()
    } else {
        user_key(&args.key)
    }
}

fn get(args: &GetArgs) -> Result<(), String> {
    let mut client = connect(&args.key.client)?;
    let key = wire_key(&args.key);
    // CHECK first: a GET of a missing key returns nothing on some servers and closes
    // the connection on torch's legacy one.
    if !client.check(&[key.as_bytes()]).map_err(|e| e.to_string())? {
        return Err(format!("no key '{key}' on the server"));
    }
    let value = client.get(key.as_bytes()).map_err(|e| e.to_string())?;
    match &args.output {
        Some(path) => {
            std::fs::write(path, &value).map_err(|e| format!("{}: {e}", path.display()))?;
            eprintln!("{} bytes written to {}", value.len(), path.display());
        }
        None => std::io::stdout()
            .write_all(&value)
            .map_err(|e| format!("writing to stdout: {e}"))?,
    }
    Ok(())
}

fn list(args: &ListArgs) -> Result<(), String> {
    let mut client = connect(&args.client)?;
    let mut keys = client
        .list_keys(1 << 22)
        .map_err(|e| format!("{e} (LIST_KEYS needs Ferry's server or torch >= 2.10)"))?;
    keys.sort();
    let mut raw_only = 0;
    for key in keys {
        let key = String::from_utf8_lossy(&key);
        match key.strip_prefix('/') {
            // What `get`/`delete` take: they put the `/` back, as torch's API does.
            Some(user) if !args.raw => println!("{user}"),
            _ => {
                raw_only += usize::from(!args.raw);
                println!("{key}");
            }
        }
    }
    if raw_only > 0 {
        eprintln!(
            "{raw_only} key(s) have no '/' prefix (not written through torch's API): \
             get and delete them with --raw"
        );
    }
    Ok(())
}

fn delete(args: &KeyArgs) -> Result<(), String> {
    let mut client = connect(&args.client)?;
    let key = wire_key(args);
    if client
        .delete_key(key.as_bytes())
        .map_err(|e| e.to_string())?
    {
        println!("deleted '{key}'");
        Ok(())
    } else {
        Err(format!("no key '{key}' on the server"))
    }
}
